"""The order in which pending work is placed: priority band first, then first come first
served by submission. The scheduler places in this order; the dashboard says where a
pending job stands in it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from berth.shared.lifecycle import JobView


def placement_key(job: JobView) -> tuple[int, int]:
    """Sorts before every job placed after it."""
    return (job.spec.priority.rank, job.submit_seq)


def band_place(job: JobView, pending: Iterable[tuple[str, int]],
               jobs: Mapping[str, JobView]) -> tuple[int, int] | None:
    """(position, length) of `job` in its band's queue of jobs with pending tasks, 1 the
    next to be placed; None when none of its tasks is pending."""
    waiting = {job_id for job_id, _ in pending}
    if job.job_id not in waiting:
        return None
    band = job.spec.priority.rank
    keys = sorted(placement_key(jobs[j]) for j in waiting if jobs[j].spec.priority.rank == band)
    return keys.index(placement_key(job)) + 1, len(keys)
