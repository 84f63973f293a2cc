"""The order in which pending work is placed: priority band first (strictly), then, within
a band, users interleaved by fair share, each user's own jobs first come first served. The
scheduler places in this order; the dashboard says where a pending job stands in it.

Fair share (docs/placement.md, "Fair share"): a waiting job's key is its user's recent use
(shared/usage.py: decayed core-seconds plus weighted device-seconds) plus what the user's
earlier waiting jobs in the band would add once placed (their `charge`), a virtual start
time as in weighted fair queueing. So a user who has used nothing goes first; two users
with equal use alternate job by job, or in proportion to their jobs' sizes; and a heavy
user's burst waits behind a light user's without starving (each job placed makes its
user's key grow)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from berth.shared import usage
from berth.shared.lifecycle import JobView


@dataclass(frozen=True, slots=True)
class Waiting:
    """A job with pending tasks, as the order sees it."""

    job_id: str
    band: int  # Priority.rank: lower is placed first
    user: str
    seq: int  # submission sequence
    charge: float  # the use its pending tasks would add (see `charge`)


def charge(job: JobView, tasks: int, fair: usage.FairShare) -> float:
    """What placing `tasks` tasks of `job` adds to its user's use, reckoned ahead: each for
    its `timeout`, or one half-life if it has none or a longer one (use older than that
    counts half anyway)."""
    cpu, dev = usage.rates(job.spec.resources.amounts)
    seconds = min(job.spec.timeout or math.inf, fair.half_life)
    return tasks * (cpu + fair.device_weight * dev) * seconds


def waiting(job: JobView, tasks: int, fair: usage.FairShare) -> Waiting:
    return Waiting(job.job_id, job.spec.priority.rank, job.spec.user, job.submit_seq,
                   charge(job, tasks, fair))


def costs(users: Mapping[str, usage.UserUsage], now: float,
          fair: usage.FairShare) -> dict[str, float]:
    """Each user's recent use as one number (usage.cost)."""
    return {name: usage.cost(u, now, fair.half_life, fair.device_weight)
            for name, u in users.items()}


def order(jobs: Iterable[Waiting], used: Mapping[str, float]) -> list[Waiting]:
    """The placement order: band, then the fair-share key (the user's use in `used`, 0 if
    absent, plus the charges of the user's earlier jobs in the band), then submission."""
    jobs = sorted(jobs, key=lambda w: (w.band, w.seq))
    if len({w.user for w in jobs}) <= 1:
        return jobs  # one user: fair share changes nothing (the common, cheap case)
    ahead: dict[tuple[int, str], float] = {}
    keyed = []
    for w in jobs:
        start = ahead.get((w.band, w.user))
        if start is None:
            start = used.get(w.user, 0.0)
        keyed.append((w.band, start, w.seq, w))
        ahead[(w.band, w.user)] = start + w.charge
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]


def pending_jobs(pending: Iterable[tuple[str, int]], jobs: Mapping[str, JobView],
                 fair: usage.FairShare) -> list[Waiting]:
    """The jobs with pending tasks, each with the charge of its pending tasks."""
    counts: dict[str, int] = {}
    for job_id, _ in pending:
        counts[job_id] = counts.get(job_id, 0) + 1
    return [waiting(jobs[j], n, fair) for j, n in counts.items()]


def band_place(job: JobView, queue: Sequence[Waiting]) -> tuple[int, int] | None:
    """(position, length) of `job` in its band's part of `queue` (as `order` gives it), 1
    the next to be placed; None when none of its tasks is pending."""
    band = [w.job_id for w in queue if w.band == job.spec.priority.rank]
    if job.job_id not in band:
        return None
    return band.index(job.job_id) + 1, len(band)
