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

from collections.abc import Iterable

import msgspec

from berth.shared import subjects
from berth.shared.messages import (
    AnyEvent,
    AttemptReported,
    AttemptsReported,
    DeviceHealthChanged,
    Heartbeat,
    JobCancelRequested,
    JobsCompacted,
    JobSubmitted,
    LeaderElected,
    NodeHealthChanged,
    PendingReasonsChanged,
    PreemptionReleased,
    QuotaSet,
    ScheduleCreated,
    SubmitDeduplicated,
    SubmitRejected,
    TaskAssigned,
    TasksAssigned,
    TasksPreempted,
    TaskUnschedulable,
    TokenLimitSet,
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
    # The kinds are disjoint: the most frequent first (each case passed over is an
    # isinstance check, for every event every reader folds).
    match event:
        case AttemptReported():
            ok = subject == subjects.attempt_reports(event.worker_id)
        case AttemptsReported():
            # Each entry as if it came alone: a worker reports only its own attempts.
            ok = subject == subjects.attempt_reports(event.worker_id) and all(
                r.worker_id == event.worker_id for r in event.reports)
        case (JobSubmitted() | SubmitRejected() | JobCancelRequested() | SubmitDeduplicated()
              | ScheduleCreated()):
            ok = subjects.is_submit_outcome(subject)
        case LeaderElected():
            ok = subject == subjects.LEADER_EVENTS
        case TaskAssigned() | TaskUnschedulable() | TasksPreempted() | PreemptionReleased():
            ok = subject == subjects.task_events(event.job_id)
        case TasksAssigned():
            # Each entry as if it came alone, of the batch's term.
            ok = subject == subjects.ASSIGNMENTS and all(
                a.epoch == event.epoch for a in event.assignments)
        case PendingReasonsChanged():
            ok = subject == subjects.PENDING_REASONS
        case WorkerDeclaredDead() | NodeHealthChanged():
            ok = subject == subjects.worker_verdicts(event.worker_id)
        case WorkerRegistered() | WorkerStopped() | DeviceHealthChanged():
            ok = subject == subjects.worker_events(event.worker_id)
        case JobsCompacted():
            ok = subject == subjects.JOBS_COMPACTED
        case QuotaSet():
            ok = subject == subjects.ADMIN_QUOTAS
        case TokenLimitSet():
            ok = subject == subjects.admin_tokens(event.name)
    if ok:
        return None
    return f"{type(event).__name__} may not come from {subject}"


# How far a `leader_elected` may jump above the highest epoch believed before it. Epochs
# come from Redis's counter, one per lease won; a gap in the log is a lease won by a
# scheduler that never logged its term (it crashed, or another was logged first), so real
# gaps are a few. An admin's mistake (or a forged message) with epoch 10^9 is refused: it
# would void every later assignment and make every later leader's epoch absurd.
MAX_EPOCH_STEP = 1000


def epoch_refusal(epoch: int, highest: int) -> str | None:
    """Why a `leader_elected` of `epoch` may not be believed after `highest`, the highest
    epoch believed so far (0: none), or None if it may. Leaders are logged in order (each
    announce checks that no other came since it read its floor), so an epoch not above the
    highest is out of order."""
    if epoch <= highest:
        return f"leader_elected of epoch {epoch} is not above {highest}, the newest believed"
    if epoch > highest + MAX_EPOCH_STEP:
        return (f"leader_elected of epoch {epoch} jumps more than {MAX_EPOCH_STEP} above "
                f"{highest}, the newest believed")
    return None


def believed_epoch(epochs: Iterable[int]) -> int:
    """The highest epoch of the `leader_elected` events `epochs` (in log order) that a fold
    believes; 0 if none."""
    highest = 0
    for epoch in epochs:
        if epoch_refusal(epoch, highest) is None:
            highest = epoch
    return highest


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
