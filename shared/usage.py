"""Each user's recent use of the cluster (cpu-seconds, device-seconds), decayed
exponentially with a half-life, kept by the fold from the log's own timestamps (an attempt
uses its job's resources from its assignment to its confirmed exit). The fair-share order
(shared/queue_order.py) reads it; a new leader folds the same log, so it derives the same
usage.

Kept in closed form, O(1) per assignment and exit whatever runs: with decay rate
k = ln 2 / half-life, an attempt using r units from s to t has added r (1 - e^{-k(t-s)}) / k
by time t. Per dimension the fold keeps, as of its last update `as_of`: `done` (the decayed
use of ended attempts), `rate` (the sum of the live attempts' r) and `live` (the sum of
their r e^{-k(as_of - s)}), all three decaying together, so that

    use(t) = done e^{-k(t - as_of)} + (rate - live e^{-k(t - as_of)}) / k."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from berth.shared.capacity import Amounts


@dataclass(frozen=True)
class FairShare:
    """How users' use is weighed (BERTH_FAIR_SHARE_HALF_LIFE, BERTH_FAIR_SHARE_DEVICE_WEIGHT,
    docs/placement.md, "Fair share"): use an hour ago counts half (by default), and a
    device-second as much as 16 core-seconds (an 8-accelerator host has ~100-200 cores)."""

    half_life: float = 3600.0
    device_weight: float = 16.0


class Decayed(msgspec.Struct, kw_only=True):
    """One dimension of one user's use; see the module docstring."""

    as_of: float = 0.0
    done: float = 0.0
    rate: float = 0.0
    live: float = 0.0


class UserUsage(msgspec.Struct, kw_only=True):
    cpu: Decayed = msgspec.field(default_factory=Decayed)  # cores
    dev: Decayed = msgspec.field(default_factory=Decayed)  # devices


def _k(half_life: float) -> float:
    return math.log(2) / half_life


def _advance(d: Decayed, t: float, k: float) -> None:
    """Moves `as_of` forward to `t` (never back: a timestamp from a clock behind counts as
    now)."""
    if t <= d.as_of:
        return
    factor = math.exp(-k * (t - d.as_of))
    d.done *= factor
    d.live *= factor
    d.as_of = t


def started(d: Decayed, r: float, at: float, half_life: float) -> None:
    if r:
        _started(d, r, at, _k(half_life))


def _started(d: Decayed, r: float, at: float, k: float) -> None:
    _advance(d, at, k)
    d.rate += r
    # exp(-k * 0) is exactly 1.0: the same sum without the call (time mostly moves on).
    d.live += r if d.as_of == at else r * math.exp(-k * (d.as_of - at))


def ended(d: Decayed, r: float, since: float, at: float, half_life: float) -> None:
    """The attempt that `started` with `r` at `since` ended at `at`."""
    if r:
        _ended(d, r, since, at, _k(half_life))


def _ended(d: Decayed, r: float, since: float, at: float, k: float) -> None:
    at = max(at, since)
    _advance(d, at, k)
    d.rate = max(0.0, d.rate - r)
    d.live = max(0.0, d.live - r * math.exp(-k * (d.as_of - since)))
    done = r * (1 - math.exp(-k * (at - since))) / k
    d.done += done if d.as_of == at else done * math.exp(-k * (d.as_of - at))
    if not d.rate:
        d.live = 0.0  # no float dust left behind once nothing runs


def use(d: Decayed, now: float, half_life: float) -> float:
    """Unit-seconds used, decayed, as of `now`."""
    k = _k(half_life)
    factor = math.exp(-k * max(0.0, now - d.as_of))
    return max(0.0, d.done * factor + max(0.0, d.rate - d.live * factor) / k)


def rates(amounts: Amounts) -> tuple[float, float]:
    """(cores, devices) an attempt of these amounts uses."""
    return amounts.cpu / 1000, float(amounts.dev)


# The two below run for every assignment and exit every fold folds: the same arithmetic as
# `started` and `ended` per dimension, with k worked out once and no call for a dimension
# the attempt does not use.
def attempt_started(u: UserUsage, amounts: Amounts, at: float, half_life: float) -> None:
    k = _k(half_life)
    cpu, dev = rates(amounts)
    if cpu:
        _started(u.cpu, cpu, at, k)
    if dev:
        _started(u.dev, dev, at, k)


def attempt_ended(u: UserUsage, amounts: Amounts, since: float, at: float,
                  half_life: float) -> None:
    k = _k(half_life)
    cpu, dev = rates(amounts)
    if cpu:
        _ended(u.cpu, cpu, since, at, k)
    if dev:
        _ended(u.dev, dev, since, at, k)


def cost(u: UserUsage, now: float, half_life: float, device_weight: float) -> float:
    """One number to compare users by: cpu core-seconds plus `device_weight` per
    device-second."""
    return use(u.cpu, now, half_life) + device_weight * use(u.dev, now, half_life)
