"""No event that decodes stops a fold: whoever may write to the events stream (an admin may
write anything on any subject), every fold (the scheduler, a standby, the dashboard,
`berth doctor`) must fold past whatever decodes. An event the fold could not handle would
stop them all, on every replay. Here: valid histories (test_lifecycle's), one event of them
changed at one leaf to a value of the same JSON kind, kept if it still decodes, and folded
in among the others. And no heartbeat stops the leader's judgement of it."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS

from berth.services.dashboard_api.projection import Projection
from berth.services.scheduler.heartbeats import judge
from berth.shared import subjects
from berth.shared.event_origin import refusal
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AnyEvent,
    AttemptsReported,
    Heartbeat,
    JobsCompacted,
    JobSpec,
    LeaderElected,
    Quota,
    QuotaSet,
    ScheduleCreated,
    ScheduleSpec,
    SubmitDeduplicated,
    SubmitRejected,
    TasksAssigned,
    TokenLimitSet,
    WorkerStopped,
    decode,
    encode,
    event_decoder,
    parse_attempt_key,
)
from berth.shared.nats_io import NO_HEADERS, RawEvent
from berth.shared.states import TaskState
from tests.test_lifecycle import J1, assigned, event_sequences, report, submitted

# Kinds test_lifecycle's histories do not make, valid as they stand.
MORE: list[AnyEvent] = [
    LeaderElected(scheduler_id="s2", epoch=2),
    JobsCompacted(job_ids=[J1], epoch=1),
    QuotaSet(user="", quota=Quota(cpu=1000, mem=None, dev=0)),
    TokenLimitSet(name="licence", limit=1),
    SubmitRejected(submit_seq=77, reason="no"),
    SubmitDeduplicated(submit_seq=78, job_id=J1, how="kept"),
    ScheduleCreated(schedule_id="s1", submit_seq=79, spec=JobSpec(
        name="nightly", command=["true"], schedule=ScheduleSpec(cron="0 3 * * *"))),
    submitted("j3-cccc", replicas=2, after=(J1,), tokens={"licence": 1}),
    TasksAssigned(epoch=1, assignments=[assigned(0, 0, "w1", job=J1),
                                        assigned(0, 1, "w2", job=J1)]),
    AttemptsReported(worker_id="w1", reports=[report(0, TaskState.RUNNING, job=J1),
                                              report(0, TaskState.SUCCEEDED, 0, job=J1)]),
    WorkerStopped(worker_id="w2", incarnation="i1"),
]

STRINGS = ["", "/", "//", "a/b", "j1-aaaa", "j1-aaaa/0", "j1-aaaa/0/0", "j1-aaaa/x/0",
           "garbage/1/2", "w1", "w2", "i1", "rack=r1", "=", "rack=", "x" * 300, "\u00e9",
           "berth.events.task.j1-aaaa", "1e9"]
INTS = [0, 1, 2, -1, 7, 10**9, 2**53, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -1.0, 1e-9, 1e18, -1e308, 1.5]


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every leaf of a JSON value, with the path to it (the "type" tag left alone)."""
    if isinstance(value, dict):
        return [leaf for k, v in value.items() if k != "type"
                for leaf in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*path, i))]
    return [(path, value)]


def _set(value: Any, path: tuple[Any, ...], leaf: Any) -> None:
    for step in path[:-1]:
        value = value[step]
    value[path[-1]] = leaf


def _replacements(old: Any) -> st.SearchStrategy[Any]:
    if isinstance(old, bool) or old is None:
        return st.sampled_from([True, False, None, 0, ""])
    if isinstance(old, int):
        return st.sampled_from(INTS) | st.integers()
    if isinstance(old, float):
        return st.sampled_from(FLOATS) | st.floats(allow_nan=False)
    return st.sampled_from(STRINGS) | st.text(max_size=20)


@st.composite
def mutated_histories(draw: st.DrawFn) -> list[AnyEvent]:
    events = draw(event_sequences())
    for extra in draw(st.lists(st.sampled_from(MORE), max_size=4)):
        events.insert(draw(st.integers(0, len(events))), extra)
    for _ in range(draw(st.integers(1, 3))):
        original = draw(st.sampled_from(events))
        tree = msgspec.json.decode(encode(original))
        leaves = _leaves(tree)
        if not leaves:
            continue
        path, old = draw(st.sampled_from(leaves))
        _set(tree, path, draw(_replacements(old)))
        try:
            changed = decode(event_decoder, msgspec.json.encode(tree))
        except msgspec.DecodeError:
            continue  # refused before any fold sees it
        events.insert(draw(st.integers(0, len(events))), changed)
    return events


@settings(max_examples=600, deadline=None)
@given(mutated_histories())
def test_no_decodable_event_stops_the_fold(events: list[AnyEvent]) -> None:
    state = ClusterState()
    for seq, event in enumerate(events, 1):
        state.apply(seq, event)


def believed_subject(event: AnyEvent) -> str | None:
    """A subject the fold believes `event` from (shared/event_origin.py), if any."""
    worker, job = getattr(event, "worker_id", ""), getattr(event, "job_id", "")
    candidates = [subjects.attempt_reports(worker), subjects.submit_outcome("u", 1),
                  subjects.LEADER_EVENTS, subjects.task_events(job), subjects.ASSIGNMENTS,
                  subjects.PENDING_REASONS, subjects.worker_verdicts(worker),
                  subjects.worker_events(worker), subjects.JOBS_COMPACTED,
                  subjects.ADMIN_QUOTAS, subjects.admin_tokens(getattr(event, "name", ""))]
    return next((c for c in candidates if refusal(c, event) is None), None)


@settings(max_examples=300, deadline=None)
@given(mutated_histories())
def test_no_decodable_event_stops_the_dashboards_projection(events: list[AnyEvent]) -> None:
    # The fold, and what the dashboard indexes beside it (job list, host timeline).
    projection = Projection(NATS(), worker_dead_after=10.0)
    for seq, event in enumerate(events, 1):
        # Some changed events no subject may bring (refused and counted, as they should be).
        subject = believed_subject(event) or subjects.ASSIGNMENTS
        projection._apply(RawEvent(seq, encode(event), NO_HEADERS, subject))
    # The dashboard's job list indexes exactly the jobs the fold holds.
    assert {job.job_id for job in projection.job_order} == set(projection.state.jobs)


KEYS = [*STRINGS, "j1-aaaa/0/1", "j2-bbbb/1/0", "j1-aaaa/2/4", "j1-aaaa/-1/0", "j1-aaaa/0/99"]


@settings(max_examples=300, deadline=None)
@given(mutated_histories(), st.lists(st.sampled_from(KEYS) | st.text(max_size=12), max_size=6),
       st.sampled_from(["w1", "w2"]), st.integers(-1, 10**6), st.sampled_from(KEYS),
       st.sampled_from(KEYS))
def test_no_heartbeat_stops_the_leaders_judgement(
        events: list[AnyEvent], listed: list[str], worker_id: str, reported_seq: int,
        covers_from: str, covers_to: str) -> None:
    """Whatever a worker lists (its heartbeat decodes whatever the strings), the leader's
    comparison with the fold neither raises nor names an attempt to kill or re-send that is
    not one: each is a parsed key, and those to re-send are live on that worker."""
    state = ClusterState()
    for seq, event in enumerate(events, 1):
        state.apply(seq, event)
    worker = state.workers.get(worker_id)
    if worker is None:
        return
    hb = Heartbeat(worker_id=worker_id, incarnation=worker.incarnation, ts=0.0,
                   attempts=listed, reported_seq=reported_seq, covers_from=covers_from,
                   covers_to=covers_to)
    verdict = judge(state, worker, hb, now=1e6, grace=2.0)
    parsed = set()
    for key in listed:
        with contextlib.suppress(ValueError):
            parsed.add(parse_attempt_key(key))
    assert set(verdict.strays) <= parsed
    for ref in [*verdict.lost_runs, *verdict.unconfirmed_kills]:
        assert ref in worker.live_attempts.values()
