"""Whether a tick may be skipped: nothing it is given has changed since a tick that placed
nothing (docs/placement.md, "Ticks that would place nothing").

With the cluster full and tens of thousands of tasks waiting, every tick walked the whole
queue to find again that nothing fits, and wrote the same reasons: ~0.4 s of the event loop
per tick at 1,000 hosts and 36,000 waiting, late lease renewals, and most of the leader's
CPU spent placing nothing (docs/performance.md). A tick's placement is a function of the
live hosts, the pending tasks, the limits in force and the clock; when it placed nothing,
every unit failed against the hosts as they were at its start (nothing was taken from them
in between), so in any order it fails again on the same hosts. The order itself (fair
share decays with the clock) matters only when something is placed. So a tick that placed
nothing, committed nothing and preempted nothing is recorded here, and the next ones are
skipped while:

- the live hosts are the very same `Host` objects (the leader rebuilds a worker's Host
  whenever its capacity, ports, devices, holder, hold or service state change, and a
  worker that dies or joins changes the list);
- no task entered or left the pending set (the fold's `pending_changes`);
- the limits in force are the same (their sequence number);
- the clock has not reached the first time something it held back comes due: a retry
  backoff's end, a waiting task's scheduling timeout, or the pending reasons' next
  announcement.

Pure: the leader (services/scheduler/service.py) carries it out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from berth.services.scheduler.placement import Host

NEVER = float("inf")


@dataclass(frozen=True, slots=True)
class IdleTick:
    """What a tick that placed nothing was given."""

    hosts: Sequence[Host]
    limits_seq: int
    until: float  # wall clock (time.time()): the first thing held back comes due


def same_hosts(before: Sequence[Host], now: Sequence[Host]) -> bool:
    """Whether `now` holds the very objects `before` held, in the same order. The leader's
    HostIndex gives the very same list while no host changed: then nothing is compared."""
    return before is now or (len(before) == len(now)
                             and all(a is b for a, b in zip(before, now, strict=True)))


def may_skip(idle: IdleTick | None, hosts: Sequence[Host], limits_seq: int,
             pending_changed: bool, now: float) -> bool:
    """Whether a tick given these would surely place nothing, as the one `idle` records."""
    return (idle is not None and not pending_changed and limits_seq == idle.limits_seq
            and now < idle.until and same_hosts(idle.hosts, hosts))


def first_after(times: Iterable[float], now: float) -> float:
    """The earliest of `times` after `now` (NEVER if none is)."""
    return min((t for t in times if t > now), default=NEVER)
