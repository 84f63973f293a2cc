"""Whether a worker is in service: pure rules over plain data (docs/operations.md, "Node
health"). The fold records what happened (shared/lifecycle.py); the scheduler asks these
rules what to do about it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Failures kept per worker: enough for any sensible threshold, bounded whatever happens.
MAX_FAILURES_KEPT = 64


@dataclass(frozen=True)
class QuarantinePolicy:
    """Quarantine a host once `failures` attempts of at least `jobs` distinct jobs failed
    there for non-user causes within `window` seconds. Several jobs, not one: a single
    job's bad input failing everywhere says nothing about the host. failures=0: never."""

    failures: int = 3
    jobs: int = 2
    window: float = 600.0
    # At most this share of the registered workers quarantined automatically (at least
    # one): a fault that strikes many hosts at once is the cluster's, not theirs, and
    # quarantining them all would stop all work (Kubernetes' node controller stops
    # evicting in an unhealthy zone for the same reason).
    max_share: float = 0.25


@dataclass(frozen=True)
class Failure:
    """An attempt that ended on a host through no fault of its task."""

    ts: float
    job_id: str


def quarantine_reason(failures: Sequence[Failure], policy: QuarantinePolicy) -> str | None:
    """Why the host should be quarantined, judged at its newest failure, or None. Judged
    from the failures' own times (the log's), so every fold of the log agrees."""
    if policy.failures <= 0 or not failures:
        return None
    now = max(f.ts for f in failures)
    recent = [f for f in failures if now - f.ts <= policy.window]
    jobs = {f.job_id for f in recent}
    if len(recent) < policy.failures or len(jobs) < policy.jobs:
        return None
    return (f"{len(recent)} attempts of {len(jobs)} jobs failed here within "
            f"{policy.window:g}s for non-user causes")


def quarantine_room(quarantined: int, workers: int, policy: QuarantinePolicy) -> bool:
    """Whether one more host may be quarantined automatically, with `quarantined` of
    `workers` registered ones already out. An operator's cordon or drain is not counted:
    only this rule's own verdicts are capped."""
    return quarantined < max(1, int(workers * policy.max_share))


def drain_overdue(deadline: float | None, now: float) -> bool:
    """Whether a drain's running attempts are to be preempted now."""
    return deadline is not None and now >= deadline


def out_of_service(cordon: str | None, draining: bool, quarantine: str | None) -> str:
    """Why a worker takes no new work, as `berth workers`, the dashboard and pending
    reasons say it; "" when it is in service. Quarantine first: it is the one an operator
    must look into."""
    if quarantine is not None:
        return f"quarantined: {quarantine}"
    if draining:
        return "draining" + (f": {cordon}" if cordon else "")
    if cordon is not None:
        return "cordoned" + (f": {cordon}" if cordon else "")
    return ""
