"""Choosing hosts for pending work: a pure function over plain data, no I/O.

Work comes in units: a single task, or a coscheduled job's pending tasks (a gang), which is
placed whole on workers sharing one value of its `group_by` attribute, or not at all. Units
are taken in priority order (the caller sorts: band, then FIFO); each placement in a call
sees the capacity, ports and group claims of the ones before it, so one call never
over-commits a host, never gives one port of an address twice, and never gives one group
to two gangs. Named ports belong to a host's address, not to a worker: workers that share
an address (several workers on one machine) draw their ports from one set. A task that asks
for N devices gets N specific free devices of its host (the lowest indices), never one
another live attempt holds. A host out of service (cordoned, draining, quarantined) takes
nothing, and the reasons of the tasks it could have taken say so. Among the hosts a single
task may take, those satisfying more of its preferred constraints come first; a gang takes
the group whose members satisfy the most of them on average."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

import msgspec

from berth.services.scheduler.matching import describe, matches, preference, required
from berth.shared import limits as limit_rules
from berth.shared.capacity import DIMENSIONS, Amounts, GroupClaim
from berth.shared.messages import Constraint, ConstraintMode, Coscheduling

if TYPE_CHECKING:
    from berth.services.scheduler.host_index import HostIndex

PORT_RANGE = range(30000, 40000)


# Structs, not frozen dataclasses, for what a tick makes per unit and per placement: a
# frozen dataclass's __init__ sets each field through object.__setattr__ (~10x slower).
class Unit(msgspec.Struct, frozen=True, gc=False):
    job_id: str
    indices: tuple[int, ...]
    need: Amounts  # per task
    device_kind: str = ""
    constraints: tuple[Constraint, ...] = ()
    ports: tuple[str, ...] = ()
    gang: Coscheduling | None = None
    # Whose quota its tasks count against, and the tokens each holds (shared/limits.py).
    user: str = ""
    tokens: tuple[tuple[str, int], ...] = ()


# The ports of a host with none taken: one object for them all (an empty set each was
# 2 MiB of the scheduler at 10,000 hosts).
NO_PORTS: frozenset[int] = frozenset()


# Slots: the scheduler keeps one per live host (HostIndex), ~150 bytes less each.
@dataclass(slots=True)
class Host:
    worker_id: str
    free: Amounts
    device_kind: str = ""
    attributes: dict[str, str] = field(default_factory=dict)
    address: str = ""
    # The job whose gang holds a group this host belongs to, exclusively.
    holder: str | None = None
    # Ports taken on this host's address (by any worker there). `place` reads it and never
    # changes it (the ports a call gives out go into _Undo.taken): NO_PORTS for most.
    ports_used: AbstractSet[int] = NO_PORTS
    # Indices of its free devices, lowest first; None: devices 0..free.dev-1 (a host whose
    # devices are not tracked one by one). Only as many as free.dev are ever given out.
    free_devices: list[int] | None = None
    # Why it takes no new work ("cordoned: ...", "quarantined: ..."), or "" (in service).
    out_of_service: str = ""
    # The preemptor this host is held for while its victims stop (docs/placement.md,
    # "Preemption"): no other job is placed on it.
    held_for: str | None = None

    @property
    def port_domain(self) -> str:
        """The unit ports are allocated per: the address, or the worker if it has none."""
        return self.address or self.worker_id


class Assignment(msgspec.Struct, frozen=True, gc=False):
    job_id: str
    task_index: int
    worker_id: str
    ports: dict[str, int]
    group: str = ""  # "tpu-name=slice-a" for a gang's task
    coordinator: str = ""  # host:port of the gang's task 0
    devices: tuple[int, ...] = ()  # indices of the host's devices it gets


@dataclass
class Placement:
    assignments: list[Assignment] = field(default_factory=list)
    groups: list[GroupClaim] = field(default_factory=list)
    pending_reasons: dict[tuple[str, int], str] = field(default_factory=dict)
    # Stopped at the limit with units left unexamined (they keep their pending reasons).
    truncated: bool = False
    # Jobs with tasks held back by a quota or a token (evicting others would not help).
    held_by_limits: set[str] = field(default_factory=set)
    # Stopped because the free capacity left, summed over every host, fell below what any
    # unit needs (`stop_below`): the units left unexamined could not be placed either.
    exhausted: bool = False


def group_name(attribute: str, value: str) -> str:
    return f"{attribute}={value}"


class _Undo:
    """What one call of `place` changed in the hosts it was given, to put back when it
    returns: it works on them in place, since a copy of every host on every call was most
    of a tick that placed a few tasks among 1,000 hosts. Also the ports taken per address
    during the call (union of the `ports_used` of the hosts there), made on first use."""

    def __init__(self, hosts: Sequence[Host]) -> None:
        self.hosts = hosts
        self.saved: dict[int, tuple[Host, Amounts, list[int] | None, str | None]] = {}
        self.taken: dict[str, set[int]] | None = None

    def save(self, host: Host) -> None:
        """Before the call first changes `host`."""
        if id(host) not in self.saved:
            self.saved[id(host)] = (host, host.free, host.free_devices, host.holder)

    def restore(self) -> None:
        for host, free, devices, holder in self.saved.values():
            host.free, host.free_devices, host.holder = free, devices, holder

    def ports(self, host: Host) -> set[int]:
        """The ports taken at the host's address: by any worker there, or by this call."""
        if self.taken is None:
            self.taken = {}
            for h in self.hosts:
                if h.ports_used:
                    self.taken.setdefault(h.port_domain, set()).update(h.ports_used)
        return self.taken.setdefault(host.port_domain, set())


def _free_ports(host: Host, names: Sequence[str], undo: _Undo) -> dict[str, int]:
    """The lowest free ports of the host's address, one per name, taken at once (so the
    next host on the same address, even within one gang, gets others)."""
    ports: dict[str, int] = {}
    if not names:
        return ports
    used = undo.ports(host)
    it = (p for p in PORT_RANGE if p not in used)
    for name in names:
        ports[name] = next(it)
    used.update(ports.values())
    return ports


def _take(host: Host, need: Amounts, undo: _Undo) -> tuple[int, ...]:
    """Takes `need` from the host; returns the devices it gets."""
    undo.save(host)
    host.free = host.free - need
    if not need.dev:
        return ()
    free = host.free_devices if host.free_devices is not None else list(
        range(host.free.dev + need.dev))
    host.free_devices = free[need.dev:]
    return tuple(free[:need.dev])


def candidates(unit: Unit, hosts: Sequence[Host]) -> list[Host]:
    """The hosts in service matching the unit's constraints and device. Asked of every
    host once per shape and call: the common shape (no constraints, no device) is tested
    without a call per host."""
    constraints, kind = unit.constraints, unit.device_kind if unit.need.dev else None
    if not constraints and kind is None:
        return [h for h in hosts if not h.out_of_service]
    return [h for h in hosts
            if not h.out_of_service and matches(h.attributes, constraints)
            and (kind is None or h.device_kind == kind)]


def _why_not(unit: Unit, hosts: Sequence[Host], candidates: Sequence[Host]) -> str:
    """Why no host can take one task of `unit`."""
    if not hosts:
        return "no live workers"
    matching = [h for h in hosts if matches(h.attributes, unit.constraints)]
    if not matching:
        return f"no worker matches constraints: {describe(required(unit.constraints))}"
    if all(h.out_of_service for h in matching):
        return f"every matching worker is out of service: {_out_of_service(matching)}"
    if not candidates:
        return f"no matching worker has device {unit.device_kind}"
    n = len(candidates)
    need = unit.need
    for dim, label, fmt in (("cpu", "cpu", _cores), ("mem", "memory", _mib),
                            ("disk", "disk", _mib), ("dev", _devices(unit.device_kind), str)):
        best = max(getattr(h.free, dim) for h in candidates)
        if getattr(need, dim) > best:
            return (f"insufficient {label}: need {fmt(getattr(need, dim))}, largest free "
                    f"{fmt(best)} on {n} worker{'s' if n != 1 else ''}")
    return "no single worker has every resource free together"


def _out_of_service(hosts: Sequence[Host]) -> str:
    out = [f"{h.worker_id} {h.out_of_service}" for h in hosts if h.out_of_service]
    return "; ".join(out[:3]) + (f"; {len(out) - 3} more" if len(out) > 3 else "")


def _devices(kind: str) -> str:
    """"gpu:h100" -> "h100 GPUs", "tpu:v5p:2x2x1" -> "v5p 2x2x1 TPU chips"."""
    family, _, variant = kind.partition(":")
    what = {"gpu": "GPUs", "tpu": "TPU chips"}.get(family, "devices")
    return f"{variant.replace(':', ' ')} {what}".strip()


def _cores(milli: int) -> str:
    return f"{milli / 1000:g} core" + ("" if milli == 1000 else "s")


def _mib(mb: int) -> str:
    return f"{mb} MiB"


HeapEntry = tuple[int, int, str, Host]  # (-preference, -free cpu, worker id, host)
FIRST_PULL = 16  # hosts moved from a HostIndex's ranking into the heap at first; doubling


class _Ranked:
    """A shape's hosts as a heap by preference, then most free cpu, then worker id. The
    common shape's, given a HostIndex, starts empty and is filled from the index's ranking
    only as far as the call reads (`fill`), in chunks that double: a tick placing a few
    tasks no longer pushes every host, and one placing 1,000 adds them in ~7 heapify
    passes. A host's rank there may be stale (a gang took from it in this call), but never
    too low: free capacity only shrinks during a call, and a stale entry is corrected
    when met."""

    __slots__ = ("chunk", "heap", "hosts", "needs_cpu", "pos", "ranked")

    def __init__(self, heap: list[HeapEntry], index: HostIndex | None = None,
                 needs_cpu: bool = False) -> None:
        self.heap = heap
        self.hosts = index.hosts if index is not None else {}
        self.ranked = index.ranked if index is not None else []
        self.pos = 0
        self.chunk = FIRST_PULL
        self.needs_cpu = needs_cpu

    def fill(self) -> None:
        """Moves ranked hosts into the heap while the next could come before its top.
        A rank and a heap entry compare directly (0, -free cpu, worker id, ...)."""
        heap, ranked = self.heap, self.ranked
        while self.pos < len(ranked) and (not heap or ranked[self.pos] < heap[0]):
            chunk = ranked[self.pos:self.pos + self.chunk]
            self.pos += len(chunk)
            self.chunk *= 2
            hosts = self.hosts
            entries = [(0, -(h := hosts[w]).free.cpu, w, h) for _, _, w in chunk]
            if self.needs_cpu:
                if chunk[-1][1] >= 0:  # past the last host with cpu free
                    self.pos = len(ranked)
                entries = [e for e in entries if e[1] < 0]
            heap.extend(entries)
            heapq.heapify(heap)


class _SingleTasks:
    """Places single tasks fast, choosing exactly what a scan of every host would (of the
    matching hosts that fit, those satisfying the most preferred constraints, of them the
    one with the most free cpu, ties to the lowest worker id):

    - the hosts matching a (constraints, device) shape are found once per call, and kept in
      a heap by preference, then free cpu (a host's preference is fixed for a shape); a
      host whose free cpu has since dropped is re-pushed when met (free capacity only
      shrinks during a call, so a stale entry is never too low);
    - with a HostIndex, the common shape's heap is filled from its ranking as needed;
    - a shape and need that found no host cannot find one later in the same call, so its
      reason is remembered and reused."""

    def __init__(self, hosts: Sequence[Host], undo: _Undo, held: dict[str, list[Host]],
                 index: HostIndex | None = None) -> None:
        """`held`: the hosts held for each preemptor. They go to it alone, so they are
        kept out of the heaps."""
        self.hosts = hosts
        self.undo = undo
        self.index = index
        self.heaps: dict[tuple[object, ...], _Ranked] = {}
        self.candidates: dict[tuple[object, ...], list[Host]] = {}
        self.failed: dict[tuple[object, ...], str] = {}
        self.held = held

    def place(self, unit: Unit, index: int, out: Placement) -> None:
        held = self.held.get(unit.job_id)  # for a preemptor; asked of every task placed
        own = [h for h in candidates(unit, held) if unit.need.fits_in(h.free)] if held else ()
        if own:
            mine = min(own, key=lambda h: (-h.free.cpu, h.worker_id))
            ports = _free_ports(mine, unit.ports, self.undo)
            out.assignments.append(Assignment(unit.job_id, index, mine.worker_id, ports,
                                              devices=_take(mine, unit.need, self.undo)))
            return
        shape = (unit.constraints, unit.device_kind if unit.need.dev else None)
        failed_key = (shape, unit.need)
        reason = self.failed.get(failed_key)
        if reason is not None:
            out.pending_reasons[(unit.job_id, index)] = reason
            return
        # A task that needs cpu never fits a host with none free (and free capacity only
        # shrinks during a call): such hosts stay out of its heap. On a busy cluster that
        # is most of them, and building the heap was a tenth of a tick at 10,000 hosts.
        needs_cpu = unit.need.cpu > 0
        ranked = self.heaps.get((shape, needs_cpu))
        if ranked is None:
            ranked = self.heaps[(shape, needs_cpu)] = self._ranked(unit, shape, needs_cpu)
        best = self._best(ranked, unit.need)
        if best is None:
            reason = _why_not(unit, self.hosts, self._found(unit, shape))
            self.failed[failed_key] = reason
            out.pending_reasons[(unit.job_id, index)] = reason
            return
        ports = _free_ports(best, unit.ports, self.undo)
        devices = _take(best, unit.need, self.undo)
        out.assignments.append(Assignment(unit.job_id, index, best.worker_id, ports,
                                          devices=devices))

    def _found(self, unit: Unit, shape: tuple[object, ...]) -> list[Host]:
        """The shape's candidates not held for a preemptor."""
        found = self.candidates.get(shape)
        if found is None:
            found = self.candidates[shape] = [
                h for h in candidates(unit, self.hosts) if h.held_for is None]
        return found

    def _ranked(self, unit: Unit, shape: tuple[object, ...], needs_cpu: bool) -> _Ranked:
        constraints = unit.constraints
        if not constraints and shape[1] is None:
            if self.index is not None:
                return _Ranked([], self.index, needs_cpu)
            # The common shape (any host in service takes it): one pass over the hosts,
            # with no list of candidates made first; every preference is 0.
            heap = [(0, -h.free.cpu, h.worker_id, h) for h in self.hosts
                    if takes_any_work(h) and (h.free.cpu > 0 or not needs_cpu)]
        else:
            # Without preferred constraints every preference is 0: not asked of each host.
            prefers = any(c.mode == ConstraintMode.PREFERRED for c in constraints)
            heap = [(-preference(h.attributes, constraints) if prefers else 0, -h.free.cpu,
                     h.worker_id, h)
                    for h in self._found(unit, shape) if h.free.cpu > 0 or not needs_cpu]
        heapq.heapify(heap)
        return _Ranked(heap)

    @staticmethod
    def _best(ranked: _Ranked, need: Amounts) -> Host | None:
        heap = ranked.heap
        passed_over: list[HeapEntry] = []
        best: Host | None = None
        while True:
            ranked.fill()
            if not heap:
                break
            neg_pref, neg_cpu, worker_id, host = heap[0]
            if -neg_cpu != host.free.cpu:  # taken from since it was pushed
                heapq.heapreplace(heap, (neg_pref, -host.free.cpu, worker_id, host))
                continue
            if need.fits_in(host.free):
                best = host
                break
            passed_over.append(heapq.heappop(heap))  # short of memory, disk or devices
        for entry in passed_over:
            heapq.heappush(heap, entry)
        return best


def order_key(host: Host, attribute: str | None) -> tuple[float, str, str]:
    raw = host.attributes.get(attribute, "") if attribute else ""
    try:
        return (float(raw), "", host.worker_id)
    except ValueError:
        return (float("inf"), raw, host.worker_id)


GroupOrders = dict[tuple[str, tuple[Constraint, ...]], list[tuple[str, list[Host]]]]


def _groups_in_order(unit: Unit, hosts: Sequence[Host], cache: GroupOrders
                     ) -> list[tuple[str, list[Host]]]:
    """The groups of the gang's `group_by` (value, members), in the order it tries them:
    the group its preferred constraints like best, then the smallest (best fit), then by
    name. Fixed for a shape during a call (attributes do not change), so computed once per
    call and shape: with 100 gangs waiting on 1,000 hosts this was most of a tick."""
    gang = unit.gang
    assert gang is not None
    shape = (gang.group_by, unit.constraints)
    ordered = cache.get(shape)
    if ordered is not None:
        return ordered
    by_value: dict[str, list[Host]] = {}
    for host in hosts:
        value = host.attributes.get(gang.group_by)
        if value is not None:
            by_value.setdefault(value, []).append(host)

    def liking(members: list[Host]) -> float:
        """The mean preference of a group's members (0 when the job states none)."""
        return sum(preference(h.attributes, unit.constraints) for h in members) / len(members)

    ordered = cache[shape] = sorted(by_value.items(),
                                    key=lambda kv: (-liking(kv[1]), len(kv[1]), kv[0]))
    return ordered


def _place_gang(unit: Unit, hosts: Sequence[Host], out: Placement, undo: _Undo,
                cache: GroupOrders | None = None, own: Sequence[Host] = ()) -> None:
    """`own`: the hosts held for this gang (its preemption's): their groups are tried
    first, so it takes what its victims were evicted for, as a single task does."""
    gang = unit.gang
    assert gang is not None
    groups = _groups_in_order(unit, hosts, {} if cache is None else cache)
    if own:
        mine = {h.attributes.get(gang.group_by) for h in own}
        groups = ([g for g in groups if g[0] in mine]
                  + [g for g in groups if g[0] not in mine])
    size = max(unit.indices) + 1
    notes: list[str] = []
    for value, members in groups:
        if any(h.holder not in (None, unit.job_id) or h.held_for not in (None, unit.job_id)
               for h in members):
            if len(notes) >= 4:
                notes.append("")  # only counted: a reason names the first four
                continue
            name = group_name(gang.group_by, value)
            held = {h.holder for h in members if h.holder not in (None, unit.job_id)}
            if held:
                notes.append(f"{name} held by {', '.join(sorted(h for h in held if h))}")
                continue
            held = {h.held_for for h in members if h.held_for not in (None, unit.job_id)}
            notes.append(f"{name} held for preemptor {', '.join(sorted(h for h in held if h))}")
            continue
        name = group_name(gang.group_by, value)
        ordered = sorted(candidates(unit, members), key=lambda h: order_key(h, gang.order_by))
        if len(ordered) < size:
            away = _out_of_service(members)
            notes.append(f"{name} has {len(ordered)} matching workers, needs {size}"
                         + (f" (out of service: {away})" if away else ""))
            continue
        short = [ordered[i].worker_id for i in unit.indices
                 if not unit.need.fits_in(ordered[i].free)]
        if short:
            notes.append(f"{name}: not enough free on {', '.join(short[:3])}"
                         + (f" and {len(short) - 3} more" if len(short) > 3 else ""))
            continue
        chosen = {i: ordered[i] for i in unit.indices}
        ports = {i: _free_ports(h, unit.ports, undo) for i, h in chosen.items()}
        zero = ordered[0]
        coordinator = ""
        if unit.ports:
            zero_port = ports[0][unit.ports[0]] if 0 in ports else None
            if zero_port is not None:
                coordinator = f"{zero.address or zero.worker_id}:{zero_port}"
        for i, host in chosen.items():
            devices = _take(host, unit.need, undo)
            out.assignments.append(Assignment(unit.job_id, i, host.worker_id, ports[i], name,
                                              coordinator, devices))
        if not gang.shareable:
            for host in members:
                undo.save(host)
                host.holder = unit.job_id
        out.groups.append(GroupClaim(name, unit.job_id, tuple(h.worker_id for h in members),
                                     not gang.shareable))
        return
    if not groups:
        reason = f"no worker has attribute {gang.group_by!r} to coschedule on"
    else:
        reason = (f"no {gang.group_by} group can take all {size} tasks: "
                  + "; ".join(notes[:4]) + (f"; {len(notes) - 4} more" if len(notes) > 4 else ""))
    for i in unit.indices:
        out.pending_reasons[(unit.job_id, i)] = reason


_FREE = attrgetter("free")
_DIMENSIONS = tuple(attrgetter(d) for d in DIMENSIONS)


def _total_free(hosts: Sequence[Host]) -> Amounts:
    """The free amounts of all hosts, summed per dimension (an Amounts per host added up
    was a tenth of a tick's placing at 1,000 hosts)."""
    frees = list(map(_FREE, hosts))
    return Amounts(*(sum(map(dimension, frees)) for dimension in _DIMENSIONS))


def takes_any_work(host: Host) -> bool:
    """In service and held for no preemptor: a single task without constraints or
    devices may go there. The common shape's heap, and a HostIndex's ranking, hold these."""
    return not host.out_of_service and host.held_for is None


def unnormalised(host: Host) -> bool:
    """Whether its free devices, tracked one by one, are out of order or fewer than its
    free count says (placement gives the lowest first, and no more than listed)."""
    devices = host.free_devices
    return devices is not None and (len(devices) < host.free.dev or (
        len(devices) > 1 and devices != sorted(devices)))


def normalise(host: Host) -> None:
    """Its free devices lowest first, and counted no higher than listed."""
    assert host.free_devices is not None
    host.free, host.free_devices = free_amounts(host), sorted(host.free_devices)


def free_amounts(host: Host) -> Amounts:
    """Its free amounts, devices counted no higher than the devices free one by one."""
    if host.free_devices is None or len(host.free_devices) >= host.free.dev:
        return host.free
    return Amounts(host.free.cpu, host.free.mem, host.free.disk, len(host.free_devices))


class _Admission:
    """Quotas and tokens during one call to `place`: each unit admitted takes its share,
    so one call never admits more than the limits allow (reserve.lua checks the same)."""

    def __init__(self, limits: limit_rules.Limits, usage: limit_rules.Usage) -> None:
        self.limits = limits
        self.usage = usage.copy()
        # Without any limit set, only units asking for tokens need a look.
        self.any_quota = bool(limits.quotas) or any(
            getattr(limits.default, d) is not None for d in limit_rules.QUOTA_DIMENSIONS)

    def refusal(self, unit: Unit, count: int) -> str | None:
        if not self.any_quota and not unit.tokens:
            return None
        return limit_rules.refusal(self.limits, self.usage, unit.user, unit.need,
                                   dict(unit.tokens), count)

    def take(self, unit: Unit, count: int) -> None:
        if count:
            limit_rules.take(self.usage, unit.user, unit.need, dict(unit.tokens), count)


def place(units: Iterable[Unit], hosts: Sequence[Host], limit: int | None = None,
          limits: tuple[limit_rules.Limits, limit_rules.Usage] | None = None,
          stop_below: Amounts | None = None, index: HostIndex | None = None) -> Placement:
    """Places units in the given order. Single tasks go to the matching host satisfying the
    most preferred constraints, then with the most free cpu (spreading replicas), ties
    broken by worker id; a gang goes whole to one group,
    task i on its i-th worker in `order_by` order, or waits with a reason. Once `limit`
    tasks are placed, the units left are not examined (a gang is never split). Ports
    are chosen per address: the union of every given host's `ports_used` at that address
    is taken. With `limits` (the limits in force and what live attempts use), a unit that
    would take its user over quota, or a token over its limit, waits with that reason (a
    gang admitted whole or not at all). With `stop_below`, no more than every unit `units`
    may yield needs in each dimension (the least of their needs), it stops as soon as the
    free capacity summed over all hosts falls below it in some dimension: no host could
    then hold any unit left (`exhausted`). Which units it placed is the same either way.
    With `index` (a HostIndex kept by the caller; `hosts` is then its `listed()`), what
    every call would rebuild from all hosts is read from it. The hosts given are as they
    were when it returns (it changes them while it runs)."""
    undo = _Undo(hosts)
    try:
        for h in hosts if index is None else ():  # an index's hosts are normalised
            # Most hosts are so already (a host without devices has none free and counts
            # none): only the others are changed, since saving every host on every call
            # was a tenth of a tick.
            if unnormalised(h):
                undo.save(h)
                normalise(h)
        return _place(units, hosts, undo, limit, limits, stop_below, index)
    finally:
        undo.restore()


def _place(units: Iterable[Unit], hosts: Sequence[Host], undo: _Undo, limit: int | None,
           limits: tuple[limit_rules.Limits, limit_rules.Usage] | None,
           stop_below: Amounts | None, host_index: HostIndex | None) -> Placement:
    admission = None if limits is None else _Admission(*limits)
    out = Placement()
    if host_index is not None:
        held_by_job = host_index.held_by_job()
    else:
        held_by_job = {}
        for h in hosts:
            if h.held_for is not None:
                held_by_job.setdefault(h.held_for, []).append(h)
    singles = _SingleTasks(hosts, undo, held_by_job, host_index)
    # A gang that found no group cannot find one later in the same call (free capacity
    # only shrinks, groups only get taken), nor can another of its shape: its reason is
    # reused, as _SingleTasks does. Not for a job with held hosts: those are its own.
    held_jobs = held_by_job.keys()
    gangs_failed: dict[tuple[object, ...], str] = {}
    group_orders: GroupOrders = {}
    # An upper bound of what any host has free (their sum: one host has at most all of
    # it), less what this call assigned.
    left = None if stop_below is None else (
        host_index.total if host_index is not None else _total_free(hosts))
    counted, need = 0, Amounts()  # assignments taken off `left`, the last unit's need
    for unit in units:
        if left is not None and stop_below is not None:
            made = len(out.assignments) - counted
            if made:  # each of the last unit's tasks placed took its need from some host
                left = left - Amounts(need.cpu * made, need.mem * made, need.disk * made,
                                      need.dev * made)
                counted += made
            if not stop_below.fits_in(left):
                out.exhausted = True
                break
            need = unit.need
        if unit.gang is not None:
            if limit is not None and len(out.assignments) >= limit:
                out.truncated = True
                break
            shape = (unit.gang, unit.indices, unit.need, unit.device_kind, unit.constraints)
            reason = None if unit.job_id in held_jobs else gangs_failed.get(shape)
            if reason is not None:
                for i in unit.indices:
                    out.pending_reasons[(unit.job_id, i)] = reason
                continue
            if admission is not None and (why := admission.refusal(unit, len(unit.indices))):
                for i in unit.indices:
                    out.pending_reasons[(unit.job_id, i)] = why
                out.held_by_limits.add(unit.job_id)
                continue
            placed = len(out.assignments)
            _place_gang(unit, hosts, out, undo, group_orders, held_by_job.get(unit.job_id, ()))
            if admission is not None:
                admission.take(unit, len(out.assignments) - placed)
            if len(out.assignments) == placed and unit.job_id not in held_jobs:
                gangs_failed[shape] = out.pending_reasons[(unit.job_id, unit.indices[0])]
            continue
        for index in unit.indices:
            if limit is not None and len(out.assignments) >= limit:
                out.truncated = True
                return out
            if admission is None:
                singles.place(unit, index, out)
                continue
            if why := admission.refusal(unit, 1):
                out.pending_reasons[(unit.job_id, index)] = why
                out.held_by_limits.add(unit.job_id)
                continue
            placed = len(out.assignments)
            singles.place(unit, index, out)
            admission.take(unit, len(out.assignments) - placed)
    return out
