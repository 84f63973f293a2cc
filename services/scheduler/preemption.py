"""Choosing what a waiting unit of a higher band evicts: a pure function over plain data.

The rule (docs/placement.md, "Preemption"):

- **Who may be evicted.** An attempt of a lower band whose job is preemptible. A gang that
  waits may also evict *non-gang* attempts of its own band from the hosts of the group it
  wants (a single task squatting on one host of a slice must not block a gang of its band
  forever: issue 15 item 2). Never an attempt of the same band otherwise, never one already
  being stopped, never one on a host held for another preemptor.
- **A gang is evicted whole**: choosing any of its attempts evicts all of them.
- **Which victims.** For each place the unit could go (a host for a task, a group for a
  gang), victims are taken lowest band first, youngest first (least work lost), until the
  unit fits; then any victim whose eviction turns out not to be needed is dropped again.
  Of the places that work, the one whose costliest victim has the lowest band wins, then
  the one evicting the fewest attempts, then the one losing the least work (the youngest
  victims), then the smallest group, then by name.
- Several units are planned in order (the caller's: band, then FIFO); each sees the hosts
  the ones before it hold, and never evicts a victim twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from berth.services.scheduler.placement import Host, Unit, candidates, free_amounts, order_key
from berth.shared.capacity import Amounts
from berth.shared.messages import Priority

# The lowest band: it never preempts anyone.
LOWEST_BAND = max(p.rank for p in Priority)


@dataclass(frozen=True)
class Running:
    """A live attempt as preemption sees it."""

    key: str  # attempt key
    job_id: str
    worker_id: str
    band: int  # Priority.rank: 0 is the highest band
    need: Amounts
    gang: bool  # its job is coscheduled: evicted whole
    preemptible: bool = True
    started: float = 0.0  # when it was assigned: a larger value is younger


@dataclass(frozen=True)
class Plan:
    job_id: str  # the preemptor
    victims: tuple[str, ...]  # attempt keys, sorted
    victim_jobs: tuple[str, ...]  # sorted
    hosts: tuple[str, ...]  # held for the preemptor, sorted
    # Per host, what the preemptor will take there (for the commit's capacity re-check).
    needs: dict[str, Amounts] = field(default_factory=dict)


def may_evict(band: int, is_gang: bool, victim: Running) -> bool:
    """Whether a unit of `band` (a gang if `is_gang`) may evict `victim`."""
    if not victim.preemptible:
        return False
    if victim.band > band:
        return True
    return is_gang and not victim.gang and victim.band == band


def could_preempt(band: int, lowest_running: int, gang: bool) -> bool:
    """Whether a waiting unit of `band` (a gang or not) might find anyone `may_evict`
    allows, `lowest_running` being the lowest band (highest rank) of any live attempt, -1
    if none: something below its band, or for a gang something of its own band; never
    from the lowest band."""
    return band < LOWEST_BAND and (band < lowest_running
                                   or (band == lowest_running and gang))


@dataclass
class _Choice:
    """Victim units chosen so far: a gang's whole job, or one single attempt."""

    units: list[tuple[str, ...]] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)

    def add(self, unit: tuple[str, ...]) -> None:
        self.units.append(unit)
        self.keys.update(unit)

    def remove(self, unit: tuple[str, ...]) -> None:
        self.units.remove(unit)
        self.keys.difference_update(unit)


class _World:
    """The running attempts, indexed for one planning call."""

    def __init__(self, running: Iterable[Running]) -> None:
        self.by_key: dict[str, Running] = {}
        self.by_host: dict[str, list[Running]] = {}
        self.by_job: dict[str, list[Running]] = {}
        for r in running:
            self.by_key[r.key] = r
            self.by_host.setdefault(r.worker_id, []).append(r)
            self.by_job.setdefault(r.job_id, []).append(r)

    def victim_unit(self, r: Running) -> tuple[str, ...]:
        """What evicting `r` evicts: its whole gang, or itself."""
        if r.gang:
            return tuple(sorted(x.key for x in self.by_job[r.job_id]))
        return (r.key,)

    def freed_on(self, worker_id: str, keys: set[str]) -> Amounts:
        return sum((r.need for r in self.by_host.get(worker_id, ()) if r.key in keys),
                   Amounts())

    def drop(self, keys: Iterable[str]) -> None:
        for key in keys:
            r = self.by_key.pop(key, None)
            if r is None:
                continue
            self.by_host[r.worker_id].remove(r)
            self.by_job[r.job_id].remove(r)


def _order(r: Running) -> tuple[int, float, str]:
    """Eviction order: lowest band (highest rank) first, then youngest first."""
    return (-r.band, -r.started, r.key)


def _fill(host: Host, need: Amounts, world: _World, band: int, is_gang: bool,
          chosen: _Choice, job_id: str) -> bool:
    """Adds victims on `host` (beyond those already chosen) until `need` fits there;
    False if it cannot."""
    free = free_amounts(host)

    def fits() -> bool:
        return need.fits_in(free + world.freed_on(host.worker_id, chosen.keys))

    if fits():
        return True
    added: list[tuple[str, ...]] = []
    for r in sorted(world.by_host.get(host.worker_id, ()), key=_order):
        if r.key in chosen.keys or r.job_id == job_id or not may_evict(band, is_gang, r):
            continue
        unit = world.victim_unit(r)
        chosen.add(unit)
        added.append(unit)
        if fits():
            break
    else:
        return False
    # Drop what turned out not to be needed, keeping the most valuable first.
    for unit in sorted(added, key=lambda u: _order(world.by_key[u[0]]), reverse=True):
        chosen.remove(unit)
        if not fits():
            chosen.add(unit)
    return True


def _cost(chosen: _Choice, world: _World) -> tuple[int, int, float]:
    victims = [world.by_key[k] for k in chosen.keys]
    top = min(r.band for r in victims)  # the most valuable band evicted
    return (-top, len(victims), -sum(r.started for r in victims))


def _plan_task(unit: Unit, band: int, hosts: Sequence[Host], world: _World) -> Plan | None:
    best: tuple[tuple[int, int, float, str], Plan] | None = None
    for host in candidates(unit, hosts):
        if host.held_for is not None:  # held for another, or for this job's other task
            continue
        chosen = _Choice()
        if not _fill(host, unit.need, world, band, False, chosen, unit.job_id) or not chosen.keys:
            continue
        key = (*_cost(chosen, world), host.worker_id)
        if best is None or key < best[0]:
            best = (key, _plan(unit.job_id, chosen, world, (host.worker_id,),
                               {host.worker_id: unit.need}))
    return None if best is None else best[1]


# A group's evaluation for one unit shape: its cost key, the victims, hosts and needs.
_GroupPlan = tuple[tuple[int, int, float, int, str], tuple[str, ...], tuple[str, ...],
                   dict[str, Amounts]]


class _Gangs:
    """Evaluates groups for gang units. Units of one shape (what they need, where, and
    their band) see the same group the same way, so a group is evaluated once per shape
    and again only after a plan touched its hosts: a hundred identical gangs arriving at
    once cost one pass over the groups, not a hundred."""

    def __init__(self, hosts: Sequence[Host], world: _World) -> None:
        self.hosts = hosts
        self.world = world
        self.groups: dict[str, dict[str, list[Host]]] = {}  # group_by -> value -> members
        self.cache: dict[tuple[object, ...], dict[str, _GroupPlan | None]] = {}

    def by_value(self, attribute: str) -> dict[str, list[Host]]:
        found = self.groups.get(attribute)
        if found is None:
            found = self.groups[attribute] = {}
            for host in self.hosts:
                value = host.attributes.get(attribute)
                if value is not None:
                    found.setdefault(value, []).append(host)
        return found

    def touched(self, worker_ids: set[str]) -> None:
        """Forgets the evaluations of every group with one of these hosts."""
        for attribute, groups in self.groups.items():
            stale = [v for v, members in groups.items()
                     if any(h.worker_id in worker_ids for h in members)]
            for evaluated in (c for k, c in self.cache.items() if k[0] == attribute):
                for value in stale:
                    evaluated.pop(value, None)

    def plan(self, unit: Unit, band: int) -> Plan | None:
        gang = unit.gang
        assert gang is not None
        shape = (gang.group_by, gang.order_by, unit.indices, unit.need, unit.device_kind,
                 unit.constraints, band)
        evaluated = self.cache.setdefault(shape, {})
        best: _GroupPlan | None = None
        for value, members in self.by_value(gang.group_by).items():
            if value not in evaluated:
                evaluated[value] = self._evaluate(unit, band, value, members)
            found = evaluated[value]
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        if best is None:
            return None
        _, victims, hosts, needs = best
        world = self.world
        return Plan(unit.job_id, victims, tuple(sorted({world.by_key[k].job_id
                                                        for k in victims})), hosts, needs)

    def _evaluate(self, unit: Unit, band: int, value: str, members: list[Host]
                  ) -> _GroupPlan | None:
        gang = unit.gang
        assert gang is not None
        world = self.world
        if any(h.held_for is not None for h in members):
            return None
        size = max(unit.indices) + 1
        ordered = sorted(candidates(unit, members), key=lambda h: order_key(h, gang.order_by))
        if len(ordered) < size:
            return None
        chosen = _Choice()
        # Another gang holding the group must go, whole, if it may.
        for holder in sorted({h.holder for h in members if h.holder is not None}):
            running = world.by_job.get(holder)
            if holder == unit.job_id or not running or not may_evict(band, True, running[0]):
                return None
            chosen.add(world.victim_unit(running[0]))
        used = [ordered[i] for i in unit.indices]
        if not all(_fill(h, unit.need, world, band, True, chosen, unit.job_id) for h in used):
            return None
        if not chosen.keys:
            return None
        needs: dict[str, Amounts] = {}
        for h in used:
            needs[h.worker_id] = needs.get(h.worker_id, Amounts()) + unit.need
        return ((*_cost(chosen, world), len(members), value), tuple(sorted(chosen.keys)),
                tuple(sorted(h.worker_id for h in members)), needs)


def _plan(job_id: str, chosen: _Choice, world: _World, hosts: tuple[str, ...],
          needs: dict[str, Amounts]) -> Plan:
    return Plan(job_id, tuple(sorted(chosen.keys)),
                tuple(sorted({world.by_key[k].job_id for k in chosen.keys})),
                tuple(sorted(hosts)), needs)


def plan(units: Iterable[tuple[Unit, int]], hosts: Sequence[Host],
         running: Iterable[Running], limit: int | None = None) -> list[Plan]:
    """The evictions for units that could not be placed, in the given order (each with its
    band). `hosts`: the live hosts with their free amounts, gang holders and preemption
    holds (`held_for`); `running`: the attempts that may be evicted and are not already
    being stopped. A unit that cannot be helped is skipped. At most `limit` plans."""
    world = _World(running)
    view = [Host(h.worker_id, h.free, h.device_kind, h.attributes, h.address, h.holder,
                 h.ports_used, h.free_devices, h.out_of_service, h.held_for) for h in hosts]
    held = {h.worker_id: h for h in view}
    gangs = _Gangs(view, world)
    out: list[Plan] = []
    for unit, band in units:
        if limit is not None and len(out) >= limit:
            break
        p = (gangs.plan(unit, band) if unit.gang is not None
             else _plan_task(unit, band, view, world))
        if p is None:
            continue
        out.append(p)
        for worker_id in p.hosts:
            held[worker_id].held_for = unit.job_id
        touched = set(p.hosts) | {world.by_key[k].worker_id for k in p.victims}
        world.drop(p.victims)
        gangs.touched(touched)
    return out
