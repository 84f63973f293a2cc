"""Which events the fold believes: an event counts only if it decodes and arrived on the one
subject its kind may be written to, by the one role nats-server lets write there.

nats-server's permissions pin each identity to its subjects (shared/bus_permissions.py), but
they cannot look inside a message: a worker may publish anything on its own report subject,
a `task_assigned` body included. So the subject is the proof of who wrote an event, and this
module checks that the body claims nothing its subject does not prove (a worker's reports
name that worker; a task's assignment names that job). Anything else, and anything that
does not decode (whatever the bytes, however deep or large), is refused: the fold records
and skips it, and never stops on it.
"""

from __future__ import annotations

import msgspec

from shared import subjects
from shared.messages import (
    AnyEvent,
    AttemptReported,
    DeviceHealthChanged,
    Heartbeat,
    JobCancelRequested,
    JobSubmitted,
    LeaderElected,
    PendingReasonsChanged,
    SubmitRejected,
    TaskAssigned,
    TaskUnschedulable,
    WorkerDeclaredDead,
    WorkerRegistered,
    WorkerStopped,
    decode,
    event_decoder,
    heartbeat_decoder,
)


class RefusedEvent(Exception):
    """An events-stream message the fold does not believe; the message says why."""


def refusal(subject: str, event: AnyEvent) -> str | None:
    """Why `event` may not be believed from `subject`, or None if it may."""
    kind = type(event).__name__
    match event:
        case JobSubmitted() | SubmitRejected() | JobCancelRequested():
            ok = subject.startswith("berth.events.submit.")
        case LeaderElected():
            ok = subject == subjects.LEADER_EVENTS
        case TaskAssigned() | TaskUnschedulable():
            ok = subject == subjects.task_events(event.job_id)
        case PendingReasonsChanged():
            ok = subject == subjects.PENDING_REASONS
        case WorkerDeclaredDead():
            ok = subject == subjects.worker_verdicts(event.worker_id)
        case WorkerRegistered() | WorkerStopped() | DeviceHealthChanged():
            ok = subject == subjects.worker_events(event.worker_id)
        case AttemptReported():
            ok = subject == subjects.attempt_reports(event.worker_id)
    if ok:
        return None
    return f"{kind} may not come from {subject}"


def read_event(subject: str, data: bytes) -> AnyEvent:
    """The event in `data`, if it is one the fold may believe from `subject`; otherwise
    RefusedEvent. Never raises anything else, whatever the bytes."""
    try:
        event: AnyEvent = decode(event_decoder, data)
    except msgspec.DecodeError as exc:
        raise RefusedEvent(f"undecodable: {exc}") from None
    why = refusal(subject, event)
    if why:
        raise RefusedEvent(why)
    return event


def read_heartbeat(subject: str, data: bytes) -> Heartbeat:
    """A heartbeat, if it decodes and names the worker whose subject it came on (only that
    worker may publish there: one naming another would keep a dead worker looking alive);
    otherwise RefusedEvent."""
    try:
        hb = decode(heartbeat_decoder, data)
    except msgspec.DecodeError as exc:
        raise RefusedEvent(f"undecodable heartbeat: {exc}") from None
    if subject != subjects.heartbeat(hb.worker_id):
        raise RefusedEvent(f"a heartbeat naming worker {hb.worker_id} on {subject}")
    return hb
