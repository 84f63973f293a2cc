"""Which finished jobs may be compacted out of the events stream, and which of the stream's
messages may go with them (docs/retention.md). Pure functions of the fold: the leader's
compaction (services/scheduler/compaction.py) carries them out."""

from __future__ import annotations

from collections.abc import Iterator

from berth.shared.lifecycle import ClusterState, JobView
from berth.shared.states import JOB_TERMINAL

# Jobs named by one JobsCompacted event: a few KiB of ids, and a lease renewal per batch.
BATCH = 200
# How often the leader looks for jobs past their retention, at most and at least.
MIN_CHECK_INTERVAL = 10.0
MAX_CHECK_INTERVAL = 3600.0


def check_interval(retention: float) -> float:
    """A tenth of the retention period, within bounds: a job is compacted at most that
    long after its retention ends."""
    return min(MAX_CHECK_INTERVAL, max(MIN_CHECK_INTERVAL, retention / 10))


def compactable(state: ClusterState, now: float, older_than: float) -> list[str]:
    """The jobs finished at least `older_than` seconds before `now` whose every attempt's
    exit is confirmed, no preemption hold is theirs, and no unfinished job still waits on
    them (a dependent re-checks all its dependencies when another one ends): dropping
    any of these changes nothing any live job or host depends on."""
    return [job_id for job_id, job in state.jobs.items()
            if _finished_before(job, now - older_than)
            and job_id not in state.holds
            and all(a.exited for t in job.tasks for a in t.attempts)
            and not any(_unfinished(state, d) for d in job.dependents)]


def _finished_before(job: JobView, cutoff: float) -> bool:
    return job.state in JOB_TERMINAL and job.finished_at is not None and (
        job.finished_at <= cutoff)


def _unfinished(state: ClusterState, job_id: str) -> bool:
    job = state.jobs.get(job_id)
    return job is not None and job.state not in JOB_TERMINAL


def outcome_seqs(state: ClusterState, job_ids: list[str]) -> list[int]:
    """The submit sequences whose stored outcomes concern only these jobs: the submit that
    made each, and the cancels and deduplicated submits that named it."""
    ids = set(job_ids)
    seqs = [job.submit_seq for i in job_ids if (job := state.jobs.get(i)) is not None]
    seqs += [seq for seq, job_id in state.cancel_by_submit.items() if job_id in ids]
    seqs += [seq for seq, (job_id, _) in state.same_by_submit.items() if job_id in ids]
    return sorted(set(seqs))


def shared_subjects_watermark(state: ClusterState) -> int:
    """The sequence below which messages on subjects shared by many jobs (attempt reports,
    pending reasons) concern only jobs already compacted: each such message names jobs
    submitted before it, and the oldest job still folded was submitted here. 0 (purge
    nothing) while a job folded from seq 0 (applied before it was logged) is left."""
    if not state.jobs:
        return state.last_seq + 1
    return min(job.first_seq for job in state.jobs.values())


def batches(job_ids: list[str], size: int = BATCH) -> Iterator[list[str]]:
    for start in range(0, len(job_ids), size):
        yield job_ids[start:start + size]
