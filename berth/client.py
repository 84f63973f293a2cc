"""Submitting over NATS (exactly what a client in any language does) and reading the API."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from berth.shared import config, subjects

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from berth.shared.messages import AnyEvent, JobSpec

# The NATS client and the messages are imported where a submit needs them: `berth jobs` and
# the other readers use only the API half of this module and start faster without them.


@dataclass(frozen=True)
class SubmitOutcome:
    submit_seq: int
    job_id: str | None
    reason: str | None
    # What an `existing`/`dedup` policy did, in words ("" when it made a plain new job):
    # "deduplicated to jX", "kept existing jX", "recreated: cancelled jY".
    note: str = ""

    @property
    def accepted(self) -> bool:
        return self.job_id is not None


async def publish_submit(nc: NATS, payload: bytes, msg_id: str | None = None,
                         subject: str = subjects.SUBMIT_JOB) -> int:
    """Publishes raw submit bytes (a job on subjects.submit_job(user), or a cancel on
    subjects.submit_cancel(user)); returns the submit stream sequence (the PubAck's seq).
    A sweep of one (`publish_submits`)."""
    [seq] = await publish_submits(nc, [payload], subject, [msg_id] if msg_id else None)
    return seq


async def publish_submits(nc: NATS, payloads: Sequence[bytes],
                          subject: str = subjects.SUBMIT_JOB,
                          msg_ids: Sequence[str] | None = None) -> list[int]:
    """`publish_submit` for many submits (a sweep), all in flight at once and their acks
    awaited together: a quarter of the client's CPU per submit of one `publish_submit`
    each (docs/performance.md). `msg_ids`: each submit's dedup id (default: a new one
    each), so that the same sweep sent again after an error makes no second job. Returns
    their submit stream sequences, in order; raises as `publish_submit` would for the
    first that failed (the others may be stored)."""
    from berth.shared import nats_io

    if msg_ids is not None and len(msg_ids) != len(payloads):
        raise ValueError(f"msg_ids: {len(msg_ids)} ids for {len(payloads)} submits")
    ids = msg_ids if msg_ids is not None else [uuid.uuid4().hex for _ in payloads]
    return await nats_io.publish_to_stream(
        nc, [(subject, payload, {"Nats-Msg-Id": msg_id})
             for payload, msg_id in zip(payloads, ids, strict=True)],
        subjects.SUBMIT_STREAM)


async def cancel_job(nc: NATS, job_id: str, reason: str = "", user: str | None = None,
                     timeout: float = 30) -> SubmitOutcome:
    """Asks berth to cancel a job as `user` (None: as an admin, on the bare subject); the
    outcome says whether the request was accepted."""
    from berth.shared.messages import CancelRequest, encode

    request = CancelRequest(job_id=job_id, reason=reason)
    seq = await publish_submit(nc, encode(request), subject=subjects.submit_cancel(user))
    return await wait_for_outcome(nc, seq, user, timeout)


def unanswered() -> tuple[type[Exception], ...]:
    """The errors of a read that got no answer, which is worth asking again."""
    import nats.errors
    import nats.js.errors

    return (nats.errors.NoRespondersError, nats.errors.TimeoutError,
            nats.errors.ConnectionReconnectingError, nats.js.errors.ServiceUnavailableError)


async def wait_for_outcome(nc: NATS, submit_seq: int, user: str | None = None,
                           timeout: float = 30) -> SubmitOutcome:
    """Waits for the submitter's verdict on submit `submit_seq` (a job or a cancel) made as
    `user`. It is read by subject, one message, as often as needed: the one read a submit
    client's permissions allow, and nothing to set up or tear down."""
    import asyncio

    import nats.js.errors

    from berth.shared.messages import decode, event_decoder

    ask_again: tuple[type[Exception], ...] = (nats.js.errors.NotFoundError, *unanswered())
    js = nc.jetstream()
    subject = subjects.submit_outcome(user, submit_seq)
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        try:
            msg = await js.get_msg(subjects.EVENTS_STREAM, subject=subject, direct=True)
            break
        except ask_again:
            # Not there yet; or, on a NATS cluster that just lost a node, no replica answered
            # (reconnecting, or the stream electing a new leader): ask again.
            if time.monotonic() + pause > deadline:
                raise TimeoutError(
                    f"no outcome for submit {submit_seq} within {timeout:g}s") from None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.25)
    event = decode(event_decoder, msg.data or b"")
    return outcome_of_event(event, subject)


def outcome_of_event(event: AnyEvent, subject: str) -> SubmitOutcome:
    """The SubmitOutcome a stored submit outcome event says."""
    from berth.shared import job_policy
    from berth.shared.messages import (
        JobCancelRequested,
        JobSubmitted,
        ScheduleCreated,
        SubmitDeduplicated,
        SubmitRejected,
    )

    if isinstance(event, JobSubmitted):
        return SubmitOutcome(event.submit_seq, event.job_id, None,
                             job_policy.recreated_words(event.replaces))
    if isinstance(event, SubmitDeduplicated):
        return SubmitOutcome(event.submit_seq, event.job_id, None,
                             job_policy.in_words(event.how, event.job_id))
    if isinstance(event, ScheduleCreated):
        return SubmitOutcome(event.submit_seq, event.schedule_id, None, "schedule")
    if isinstance(event, JobCancelRequested):
        return SubmitOutcome(event.submit_seq, event.job_id, None)
    if isinstance(event, SubmitRejected):
        return SubmitOutcome(event.submit_seq, None, event.reason)
    raise RuntimeError(f"unexpected event on {subject}: {event!r}")


async def submit_job(nc: NATS, spec: JobSpec, user: str | None = None,
                     timeout: float = 30) -> SubmitOutcome:
    from berth.shared.messages import encode

    seq = await publish_submit(nc, encode(spec), subject=subjects.submit_job(user))
    return await wait_for_outcome(nc, seq, user, timeout)


def load_spec_file(path: str) -> bytes:
    """A job spec file (JSON if it ends in .json, else YAML 1.2; "-" for standard input) as
    the JSON bytes of a submit message. Validation is the submitter's; this only converts
    the format (berth/spec_files.py). Raises ValueError (one line) or OSError."""
    from berth.spec_files import load_spec

    return load_spec(path)


class ApiError(Exception):
    pass


def api_get(api_url: str, path: str, timeout: float = 10) -> Any:
    return json.loads(api_fetch(api_url, path, timeout))


def api_fetch(api_url: str, path: str, timeout: float = 10) -> bytes:
    """The body of GET `path`; any failure is an ApiError saying what went wrong."""
    return b"".join(api_stream(api_url, path, timeout))


def api_stream(api_url: str, path: str, timeout: float | None = 10) -> Iterator[bytes]:
    """The body of GET `path` as it arrives (a followed log: until the server ends it);
    `timeout` bounds each wait for more. Any failure is an ApiError saying what went wrong."""
    import urllib.error
    import urllib.request

    # Needed only where the dashboard runs with BERTH_API_CLOSED_READS.
    token = config.cli_api_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(api_url.rstrip("/") + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            while chunk := resp.read1(65536):
                yield chunk
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("detail", "")
        except Exception:
            detail = ""
        raise ApiError(f"{exc.code} {detail or exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ApiError(f"cannot reach the berth API at {api_url}: {exc}") from exc
