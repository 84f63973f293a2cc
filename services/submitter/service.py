"""The submitter process: a durable pull consumer on the submit stream."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import AbstractContextManager
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import trace

from berth.services.submitter import metrics
from berth.services.submitter.index import JobIndex
from berth.services.submitter.intake import intake, intake_cancel, unknown_subject
from berth.shared import metrics as shared_metrics
from berth.shared import nats_io, pull_fetch, service, subjects, telemetry
from berth.shared.config import Settings
from berth.shared.credentials import Role
from berth.shared.job_ids import job_id_for, schedule_id_for, submit_seq_of
from berth.shared.messages import (
    AnyEvent,
    JobCancelRequested,
    JobSubmitted,
    ScheduleCreated,
    SubmitDeduplicated,
    SubmitRejected,
    decode,
    event_decoder,
    fire_decoder,
)

log = logging.getLogger("berth.submitter")
tracer = telemetry.tracer("berth.submitter")

# Submits fetched, and outcomes in flight, at once. Bounded by the ack wait: a batch's last
# submit must be stored well inside 30 s even with retries.
SUBMIT_BATCH = 256


Outcome = (JobSubmitted | JobCancelRequested | SubmitRejected | SubmitDeduplicated
           | ScheduleCreated)


async def handle(js: JetStreamContext, outcomes: nats_io.EventPublisher, msg: Msg,
                 max_bytes: int, earlier: list[asyncio.Future[Any]], index: JobIndex,
                 taken: Outcome | None = None) -> None:
    """Decides one submit and stores its outcome; `earlier` are the batch's submits before
    it, still being stored (a cancel or a child may name a job one of them creates).
    `taken`: the job submit's intake (`intake_job`), when already made."""
    with _span(msg):
        outcome = await decide(js, msg, max_bytes, earlier, index, taken)
        await record(outcomes, msg, outcome)


def _span(msg: Msg) -> AbstractContextManager[Any]:
    # Nothing records (telemetry.recording): no span, and the outcome carries the trace
    # context the submit came with, as the scheduler's run commands then do.
    if not telemetry.recording():
        return telemetry.NO_SPAN
    return tracer.start_as_current_span(
        "submit", context=telemetry.extract(msg.headers),
        attributes={"berth.submit_seq": nats_io.stream_seq(msg), "berth.subject": msg.subject})


def record(outcomes: nats_io.EventPublisher, msg: Msg, outcome: Outcome) -> asyncio.Future[int]:
    """Counts and logs a submit's outcome and has it stored: the future of its sequence.
    In the submit's span, if any (the outcome carries its trace context)."""
    seq = nats_io.stream_seq(msg)
    recording = telemetry.recording()
    span = trace.get_current_span() if recording else trace.INVALID_SPAN
    metrics.decided(outcome)
    if isinstance(outcome, JobSubmitted):
        span.set_attribute("berth.job_id", outcome.job_id)
        # DEBUG: the events stream records every accepted job (`berth status`, the API);
        # a line each at INFO was a fifth of this process's CPU at 2,000 jobs/s, and
        # ~170 million lines a day.
        log.debug("job %s (%s) accepted from submit %d", outcome.job_id, outcome.spec.name,
                  seq)
    elif isinstance(outcome, SubmitDeduplicated):
        span.set_attribute("berth.job_id", outcome.job_id)
        log.info("submit %d %s job %s", seq, outcome.how, outcome.job_id)
    elif isinstance(outcome, ScheduleCreated):
        log.info("schedule %s (%s) made from submit %d", outcome.schedule_id,
                 outcome.spec.name, seq)
    elif isinstance(outcome, JobCancelRequested):
        span.set_attribute("berth.job_id", outcome.job_id)
        log.info("cancel of job %s accepted from submit %d", outcome.job_id, seq)
    else:
        span.set_attribute("berth.rejected", outcome.reason)
        log.info("submit %d rejected: %s", seq, outcome.reason)
    # The dedup id is the submit sequence: a redelivered submit is the same outcome.
    return outcomes.submit(subjects.submit_outcome(_outcome_user(msg.subject, outcome), seq),
                           outcome, msg_id=f"submit-outcome:{seq}",
                           passed_on=None if recording else msg.headers or {})


def _outcome_user(subject: str, outcome: Outcome) -> str | None:
    """Whose outcome subject it lands on: the submitter's, or for a schedule's fire, the
    schedule's owner (so they read their scheduled jobs' outcomes like their own)."""
    if subjects.is_schedule_fire(subject) and isinstance(outcome, JobSubmitted):
        return outcome.spec.user or None
    return subjects.submit_user(subject)


async def handle_batch(js: JetStreamContext, outcomes: nats_io.EventPublisher,
                       batch: list[Msg], max_bytes: int, index: JobIndex) -> None:
    """Stores the outcomes of a fetched batch with their publishes in flight together (one
    round trip per batch, not per submit), then acknowledges each submit whose outcome is
    stored. A job submit that needs nothing read (most) is decided here, with no task of
    its own (docs/performance.md, twenty-sixth session), up to the first submit that reads
    the stream; that one and all after it get a task each,
    started in batch order (so a later one that reads nothing may be stored before it)."""
    handled: list[asyncio.Future[Any]] = []
    tasks = False
    for msg in batch:
        taken, final = (None, False) if tasks else _intake_now(msg, max_bytes)
        if final:
            assert taken is not None
            with _span(msg):
                handled.append(record(outcomes, msg, taken))
            continue
        tasks = True
        handled.append(asyncio.create_task(
            handle(js, outcomes, msg, max_bytes, list(handled), index, taken)))
    for msg, stored in zip(batch, handled, strict=True):
        try:
            await stored
        except Exception:
            # Input never gets here (intake cannot raise); this is NATS trouble.
            # Leave the message unacked: it is redelivered and handled again.
            log.exception("could not record the outcome of a submit; will retry")
            await msg.nak(delay=1.0)
        else:
            await msg.ack()


def _intake_now(msg: Msg, max_bytes: int) -> tuple[Outcome | None, bool]:
    """`intake_job`, whose errors (none are expected) the submit's task meets again."""
    try:
        return intake_job(msg, max_bytes)
    except Exception:
        return None, False


def intake_job(msg: Msg, max_bytes: int) -> tuple[Outcome | None, bool]:
    """A job submit's intake, and whether it is its outcome (`decide` would read nothing
    more: no job, token, schedule or policy named); (None, False) for any other submit."""
    user = subjects.submit_user(msg.subject)
    if user == "" or msg.subject != subjects.submit_job(user):
        return None, False
    outcome = intake(msg.data, nats_io.stream_seq(msg), nats_io.stored_ns(msg), max_bytes, user)
    if not isinstance(outcome, JobSubmitted):
        return outcome, True
    spec = outcome.spec
    return outcome, not (spec.parent or spec.after or spec.after_any or spec.tokens
                         or spec.schedule is not None or spec.existing is not None
                         or spec.dedup is not None)


async def decide(js: JetStreamContext, msg: Msg, max_bytes: int,
                 earlier: list[asyncio.Future[Any]], index: JobIndex,
                 taken: Outcome | None = None) -> Outcome:
    """The outcome of one submit stream message: the pure intake (or `taken`, a job
    submit's, already made), then a check that any job it names exists (so a typo in a job
    id is a clear rejection, not a silent no-op). The check waits for `earlier` outcomes
    to be stored first, as if handled one by one."""
    seq = nats_io.stream_seq(msg)
    if subjects.is_schedule_fire(msg.subject):
        fired = await schedule_fire(js, msg, max_bytes)
        if not isinstance(fired, JobSubmitted):
            return fired
        return await with_policy(js, fired, index, fired.spec.user or None)
    user = subjects.submit_user(msg.subject)
    # A user may name (as parent, dependency, or to cancel) only a job of their own.
    yours = f" of {user!r}" if user else ""
    if user == "":
        return unknown_subject(msg.subject, seq)
    if msg.subject == subjects.submit_job(user):
        outcome: Outcome = taken if taken is not None else intake(
            msg.data, seq, nats_io.stored_ns(msg), max_bytes, user)
        if not isinstance(outcome, JobSubmitted):
            return outcome
        # Dependencies must exist already, so no cycle can ever form.
        named = [("parent", outcome.spec.parent)] if outcome.spec.parent else []
        named += [(f"after[{i}]", job_id) for i, job_id in enumerate(outcome.spec.after)]
        named += [(f"after_any[{i}]", job_id) for i, job_id in enumerate(outcome.spec.after_any)]
        for field, job_id in named:
            if not await job_exists(js, job_id, earlier, user):
                return SubmitRejected(submit_seq=seq, ts=outcome.ts,
                                      reason=f"{field}: no job {job_id!r}{yours}")
        for name in sorted(outcome.spec.tokens):
            if not await token_exists(js, name):
                return SubmitRejected(
                    submit_seq=seq, ts=outcome.ts,
                    reason=f"tokens.{name}: no such token (an admin creates it: "
                    f"`berth tokens set {name} N`)")
        if outcome.spec.schedule is not None:
            return ScheduleCreated(schedule_id=schedule_id_for(seq, nats_io.stored_ns(msg)),
                                   submit_seq=seq, spec=outcome.spec, ts=outcome.ts)
        return await with_policy(js, outcome, index, user)
    if msg.subject == subjects.submit_cancel(user):
        outcome = intake_cancel(msg.data, seq, max_bytes, user)
        if isinstance(outcome, JobCancelRequested) and not await job_exists(
                js, outcome.job_id, earlier, user):
            return SubmitRejected(submit_seq=seq, ts=outcome.ts,
                                  reason=f"job_id: no job {outcome.job_id!r}{yours}")
        return outcome
    return unknown_subject(msg.subject, seq)


async def with_policy(js: JetStreamContext, outcome: JobSubmitted, index: JobIndex,
                      user: str | None) -> Outcome:
    """A new job, as its `existing` and `dedup` say (shared/job_policy.py). Without them,
    the job as it is, at no cost."""
    spec = outcome.spec
    if spec.existing is None and spec.dedup is None:
        return outcome
    seq = outcome.submit_seq
    # Redelivered after its outcome was stored: that verdict stands (deciding again could
    # see the existing job ended meanwhile, and say otherwise).
    if (stored := await stored_outcome(js, user, seq)) is not None:
        return stored
    verdict = await index.verdict(spec, seq)
    if verdict.error:
        return SubmitRejected(submit_seq=seq, ts=outcome.ts, reason=verdict.error)
    if verdict.same:
        return SubmitDeduplicated(submit_seq=seq, job_id=verdict.same, how=verdict.how,
                                  ts=outcome.ts)
    return msgspec.structs.replace(outcome, replaces=verdict.replaces)


async def _stored_event(js: JetStreamContext, subject: str) -> AnyEvent | None:
    """The newest event stored on `subject` (one direct read, no fold), or None if there is
    none or it does not decode."""
    try:
        stored = await js.get_last_msg(subjects.EVENTS_STREAM, subject)
    except nats.js.errors.NotFoundError:
        return None
    try:
        event: AnyEvent = decode(event_decoder, stored.data or b"")
    except msgspec.DecodeError:
        return None
    return event


async def stored_outcome(js: JetStreamContext, user: str | None, seq: int) -> Outcome | None:
    event = await _stored_event(js, subjects.submit_outcome(user, seq))
    return event if isinstance(event, Outcome) else None


async def schedule_fire(js: JetStreamContext, msg: Msg, max_bytes: int
                        ) -> JobSubmitted | SubmitRejected:
    """The job of one fire of a schedule: the schedule's spec without `schedule`, as its
    owner submitted it, marked with the schedule and the fire time."""
    seq = nats_io.stream_seq(msg)
    now = time.time()
    if len(msg.data) > max_bytes:
        return SubmitRejected(submit_seq=seq, ts=now, reason="schedule fire: too large")
    try:
        fire = decode(fire_decoder, msg.data)
    except msgspec.DecodeError as exc:
        return SubmitRejected(submit_seq=seq, ts=now, reason=f"invalid schedule fire: {exc}")
    created = await schedule_of(js, fire.schedule_id)
    if created is None:
        return SubmitRejected(submit_seq=seq, ts=now,
                              reason=f"schedule_id: no schedule {fire.schedule_id!r}")
    spec = msgspec.structs.replace(created.spec, schedule=None)
    return JobSubmitted(job_id=job_id_for(seq, nats_io.stored_ns(msg)), submit_seq=seq, spec=spec,
                        schedule_id=fire.schedule_id, fire_at=fire.at, ts=now)


async def schedule_of(js: JetStreamContext, schedule_id: str) -> ScheduleCreated | None:
    """The stored outcome that made the schedule `schedule_id` (anyone's), or None."""
    submit_seq = submit_seq_of(schedule_id)
    if submit_seq is None:
        return None
    event = await _stored_event(js, subjects.submit_outcome("*", submit_seq))
    if isinstance(event, ScheduleCreated) and event.schedule_id == schedule_id:
        return event
    return None


async def job_exists(js: JetStreamContext, job_id: str,
                     earlier: list[asyncio.Future[Any]], user: str | None) -> bool:
    """A job id names its submit sequence; the job exists iff that submit's stored outcome
    created exactly this id (for a user: under that user's outcomes, so it is theirs; for
    an admin, under anyone's). One direct read, no fold needed."""
    submit_seq = submit_seq_of(job_id)
    if submit_seq is None:
        return False
    # Whether an earlier one failed is its own task's business (it is redelivered).
    await asyncio.gather(*earlier, return_exceptions=True)
    event = await _stored_event(js, subjects.submit_outcome(user or "*", submit_seq))
    if isinstance(event, ScheduleCreated):
        return event.schedule_id == job_id
    return isinstance(event, JobSubmitted) and event.job_id == job_id


async def token_exists(js: JetStreamContext, name: str) -> bool:
    """Whether an admin has set a limit for token `name`: one direct read of the newest
    message on its admin subject."""
    try:
        await js.get_last_msg(subjects.EVENTS_STREAM, subjects.admin_tokens(name))
    except nats.js.errors.NotFoundError:
        return False
    return True




async def run(settings: Settings, stop: asyncio.Event) -> None:
    nc = await nats_io.connect_service(settings, "berth-submitter", Role.SUBMITTER)
    js = nc.jetstream()
    await nats_io.ensure_streams(js, settings.stream_replicas)
    # Created during an election (a node just lost), this can time out: wait it out.
    consumer = functools.partial(
        js.pull_subscribe,
        subjects.SUBMIT_ALL,
        durable=subjects.SUBMITTER_DURABLE,
        stream=subjects.SUBMIT_STREAM,
        config=ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, deliver_policy=DeliverPolicy.ALL
        ),
    )
    sub = await nats_io.while_cluster_forms("the submitter's consumer", consumer)
    outcomes = nats_io.EventPublisher(js)
    index = JobIndex(js)
    serving = await shared_metrics.serve(settings.metrics_host, settings.metrics_port)
    log.info("serving %s", subjects.SUBMIT_ALL)
    try:
        while not stop.is_set():
            try:
                batch = await pull_fetch.fetch(sub, SUBMIT_BATCH, 0.5)
            except (nats.errors.TimeoutError, TimeoutError):
                continue  # nothing to do; nats-py raises either class for an idle fetch
            except nats.errors.Error as exc:
                # A disconnect or server hiccup: the client reconnects; keep serving.
                log.warning("fetching submits failed (%s); retrying", exc)
                await service.wait_or_stop(stop, 0.5)
                continue
            await handle_batch(js, outcomes, batch, settings.max_submit_bytes, index)
    finally:
        await index.close()
        if serving is not None:
            await serving.stop()
        await sub.unsubscribe()
        await nats_io.close(nc)


def main() -> None:
    settings = Settings.from_env()
    service.run("submitter", lambda stop: run(settings, stop))
