"""The submitter's metrics (docs/metrics.md): submits by outcome."""

from __future__ import annotations

from prometheus_client import Counter

from berth.shared.messages import (
    JobCancelRequested,
    JobSubmitted,
    ScheduleCreated,
    SubmitDeduplicated,
    SubmitRejected,
)

SUBMITS = Counter("berth_submits", "Submits decided, by kind (job, cancel) and outcome "
                  "(accepted, rejected, kept, deduplicated)", ["kind", "outcome"])
# Looked up once: `labels` validates and locks on every call, which was 4 % of this process's
# CPU with a submit each; made at start, each series also reads 0 before its first submit.
JOBS_ACCEPTED = SUBMITS.labels("job", "accepted")
SCHEDULES_ACCEPTED = SUBMITS.labels("schedule", "accepted")
CANCELS_ACCEPTED = SUBMITS.labels("cancel", "accepted")
REJECTED = SUBMITS.labels("any", "rejected")


def decided(outcome: JobSubmitted | JobCancelRequested | SubmitRejected | SubmitDeduplicated
            | ScheduleCreated) -> None:
    if isinstance(outcome, JobSubmitted):
        JOBS_ACCEPTED.inc()
    elif isinstance(outcome, SubmitDeduplicated):
        SUBMITS.labels("job", outcome.how).inc()
    elif isinstance(outcome, ScheduleCreated):
        SCHEDULES_ACCEPTED.inc()
    elif isinstance(outcome, JobCancelRequested):
        CANCELS_ACCEPTED.inc()
    else:
        # A rejection does not say what it would have been; the subject does, but a
        # malformed one is neither: counted as one kind.
        REJECTED.inc()
