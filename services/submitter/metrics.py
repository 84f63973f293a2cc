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


def decided(outcome: JobSubmitted | JobCancelRequested | SubmitRejected | SubmitDeduplicated
            | ScheduleCreated) -> None:
    if isinstance(outcome, JobSubmitted):
        SUBMITS.labels("job", "accepted").inc()
    elif isinstance(outcome, SubmitDeduplicated):
        SUBMITS.labels("job", outcome.how).inc()
    elif isinstance(outcome, ScheduleCreated):
        SUBMITS.labels("schedule", "accepted").inc()
    elif isinstance(outcome, JobCancelRequested):
        SUBMITS.labels("cancel", "accepted").inc()
    else:
        # A rejection does not say what it would have been; the subject does, but a
        # malformed one is neither: counted as one kind.
        SUBMITS.labels("any", "rejected").inc()
