"""The scheduler's only way to write placement: fenced, atomic Lua calls on Redis.

Every call carries the leader's epoch; a deposed leader's call is refused by the script
(docs/invariants.md, invariant 4), never half-applied.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from berth.shared import redis_keys
from berth.shared.capacity import Amounts, GroupClaim
from berth.shared.redis_io import ScriptCall, load_script, run_scripts

# Hosts registered per pipeline (register_hosts): ~150 bytes of arguments each.
REGISTER_BATCH = 500


class StaleEpochError(Exception):
    """This scheduler's epoch is no longer current: another leader has taken over."""


class ReservationConflict(Exception):
    """Redis disagrees with the scheduler's view (e.g. a host is fuller than it thought)."""


class NotDurable(Exception):
    """A fenced write that too few replicas acknowledged in time: applied on the primary,
    but a failover now could lose it, so the writer must not act on it."""


# A Struct, not a frozen dataclass: one per placement, and a frozen dataclass's __init__
# sets each field through object.__setattr__ (2.3 against 0.14 us here).
class Reservation(msgspec.Struct, frozen=True, gc=False):
    worker_id: str
    attempt_key: str
    job_id: str
    need: Amounts
    device_kind: str = ""
    ports: tuple[int, ...] = ()
    group: str = ""  # the coscheduling group name ("tpu-name=slice-a") of a gang's task
    # The host address its ports are reserved on ("" for the worker id): ports belong to an
    # address, which several workers may share.
    address: str = ""
    devices: tuple[int, ...] = ()  # the host's device indices it holds, one per need.dev
    # Whose quota it counts against, and the tokens it holds (shared/limits.py).
    user: str = ""
    tokens: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Eviction:
    """A preemption's commit: `victims` (worker id, attempt key) are evicted and `hosts` held
    for preemptor `job_id`, which will take `needs` (per worker id) there."""

    job_id: str
    hosts: tuple[str, ...]
    victims: tuple[tuple[str, str], ...]
    needs: dict[str, Amounts]


@dataclass(frozen=True)
class Allocation:
    job_id: str
    need: Amounts
    ports: tuple[int, ...]
    group: str  # group name, "" if none
    address: str = ""  # the address its ports are reserved on
    devices: tuple[int, ...] = ()
    user: str | None = None  # None: reserved before quotas were tracked
    tokens: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class HostRecord:
    """What register_hosts records of a host."""

    worker_id: str
    capacity: Amounts
    device_kind: str
    devices: tuple[int, ...] | None = None  # its device indices; None: 0..capacity.dev-1


@dataclass(frozen=True)
class HostUsage:
    worker_id: str
    capacity: Amounts
    used: Amounts
    device_kind: str
    gang: str | None
    allocations: dict[str, Allocation]
    held_for: str | None = None  # the preemptor it is held for (preempt.lua)


@dataclass(frozen=True)
class GroupUsage:
    name: str
    owner: str
    members: tuple[str, ...]  # worker ids
    exclusive: bool
    live: int


@dataclass(frozen=True)
class UsageSnapshot:
    """What the checker reads of Redis, in one MULTI (ReservationStore.snapshot)."""

    hosts: list[HostUsage]
    groups: list[GroupUsage]
    limits_used: dict[str, str]  # redis_keys.LIMITS_USED
    released_through: int  # redis_keys.RELEASED_THROUGH (0: never written)


def _check(result: list[str]) -> int:
    status, detail = result[0], result[1]
    if status == "stale_epoch":
        raise StaleEpochError(f"epoch is now {detail}")
    if status == "conflict":
        raise ReservationConflict(detail)
    return int(detail)


def _refused(result: Any) -> bool:
    """A fenced script's refusal: it wrote nothing (every script here is all or nothing)."""
    return isinstance(result, list) and bool(result) and result[0] in ("stale_epoch",
                                                                       "conflict")


def _host_keys(worker_id: str, address: str) -> list[str]:
    return [redis_keys.host(worker_id), redis_keys.host_allocations(worker_id),
            redis_keys.address_ports(address or worker_id), redis_keys.host_devices(worker_id)]


def _worker_of_host_key(key: str) -> str:
    return key.removeprefix(redis_keys.host(""))


def _group_name_of_key(key: str) -> str:
    return key.removeprefix(redis_keys.group(""))


class ReservationStore:
    def __init__(self, client: aioredis.Redis, wait_replicas: int = 0,
                 wait_timeout: float = 0.5) -> None:
        """`wait_replicas`: how many replicas must acknowledge every fenced write (lease,
        hosts, reservations, releases) within `wait_timeout` seconds, else NotDurable."""
        self.client = client
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = max(1, int(wait_timeout * 1000))
        self._reserve = load_script(client, "reserve")
        self._release = load_script(client, "release")
        self._register = load_script(client, "register_host")
        self._lease = load_script(client, "lease")
        self._preempt = load_script(client, "preempt")
        self._unhold = load_script(client, "unhold")
        self._set_limits = load_script(client, "set_limits")

    async def _fenced(self, script: AsyncScript, keys: list[str], args: Sequence[str | int | bytes]
                      ) -> Any:
        """Runs a write script (`_fenced_calls`)."""
        (result,) = await self._fenced_calls([(script, keys, args)])
        return result

    async def _fenced_batch(self, script: AsyncScript,
                            calls: Sequence[tuple[list[str], list[str | int]]]) -> list[Any]:
        """Runs the write script once per (keys, args), as `_fenced_calls` does."""
        return await self._fenced_calls([(script, keys, args) for keys, args in calls])

    async def _fenced_calls(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Runs write scripts in order in one round trip, then (with replicas to wait for)
        WAIT on the same connection: WAIT counts the replicas that have every write of its
        own connection, so all go in one pipeline. Their results in order."""
        if not self.wait_replicas:
            if len(calls) == 1:
                script, keys, args = calls[0]
                return [await script(keys=keys, args=args)]
            return await run_scripts(self.client, calls, wrote_nothing=_refused)
        *results, acked = await run_scripts(
            self.client, calls, [("WAIT", self.wait_replicas, self.wait_timeout_ms)],
            wrote_nothing=_refused)
        if int(acked) < self.wait_replicas:
            raise NotDurable(f"{acked} of {self.wait_replicas} replicas acknowledged "
                             f"within {self.wait_timeout_ms} ms")
        return results

    async def acquire_lease(self, scheduler_id: str, ttl_ms: int, floor: int = 0) -> int:
        """Returns this scheduler's epoch while it holds the lease, 0 while another does.
        The epoch is above `floor` (the highest epoch the event log has seen): a holder
        whose epoch is not takes a fresh one."""
        keys = [redis_keys.LEADER, redis_keys.EPOCH]
        return int(await self._fenced(self._lease, keys, [scheduler_id, ttl_ms, floor]))

    async def register_host(self, epoch: int, worker_id: str, capacity: Amounts,
                            device_kind: str, devices: Sequence[int] | None = None) -> None:
        """`devices`: its device indices (default 0..capacity.dev-1)."""
        await self.register_hosts(epoch, [HostRecord(worker_id, capacity, device_kind,
                                                     None if devices is None else
                                                     tuple(devices))])

    async def register_hosts(self, epoch: int, hosts: Sequence[HostRecord]) -> None:
        """Records many hosts' capacities, each by its own fenced script, in pipelines of
        REGISTER_BATCH: one round trip per batch, not per host (a fleet registering at once,
        or a new leader's reconcile, was thousands of round trips with the fold waiting on
        each). Raises on the first refusal; those before it are recorded, which is
        harmless: registering a host again only sets its capacity again."""
        for start in range(0, len(hosts), REGISTER_BATCH):
            calls: list[tuple[list[str], list[str | int]]] = []
            for h in hosts[start:start + REGISTER_BATCH]:
                ids = list(range(h.capacity.dev)) if h.devices is None else list(h.devices)
                calls.append(([redis_keys.EPOCH, redis_keys.host(h.worker_id), redis_keys.HOSTS],
                              [epoch, h.worker_id, h.capacity.cpu, h.capacity.mem,
                               h.capacity.disk, h.capacity.dev, h.device_kind, json.dumps(ids)]))
            for result in await self._fenced_batch(self._register, calls):
                _check(result)

    async def set_limits(self, epoch: int, fields: dict[str, str]) -> None:
        """Replaces the quotas and token limits reserve.lua enforces (limits.redis_fields)."""
        keys = [redis_keys.EPOCH, redis_keys.LIMITS]
        _check(await self._fenced(self._set_limits, keys, [epoch, json.dumps(fields)]))

    async def limits(self) -> tuple[dict[str, str], dict[str, str]]:
        """The limits hash and the limits-use hash, read together."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(redis_keys.LIMITS)
            pipe.hgetall(redis_keys.LIMITS_USED)
            limits, used = await pipe.execute()
        return limits, used

    async def reserve(self, epoch: int, placements: Sequence[Reservation],
                      groups: Sequence[GroupClaim] = (), check_limits: bool = True,
                      releases: Sequence[tuple[str, str]] = (), released_through: int = 0
                      ) -> None:
        """Commits all placements and group claims, or none (raises StaleEpochError or
        ReservationConflict). Quotas and tokens are checked unless `check_limits` is false
        (re-reserving attempts that already run: a lowered limit stops nothing).
        `releases` and `released_through` (as `release` takes them) are written first, in
        the same round trip; they stand whether or not the placements are refused."""
        calls = [self._release_call(epoch, releases, released_through)] if releases else []
        if placements:
            calls.append(self._reserve_call(epoch, placements, groups, check_limits))
        if calls:
            for result in await self._fenced_calls(calls):
                _check(result)

    def _reserve_call(self, epoch: int, placements: Sequence[Reservation],
                      groups: Sequence[GroupClaim], check_limits: bool) -> ScriptCall:
        hosts: dict[str, int] = {}
        addresses: dict[str, str] = {}
        for p in placements:
            hosts.setdefault(p.worker_id, len(hosts))
            addresses.setdefault(p.worker_id, p.address)
        for g in groups:
            for m in g.members:
                hosts.setdefault(m, len(hosts))
        group_index = {g.name: j for j, g in enumerate(groups)}
        keys = [redis_keys.EPOCH, redis_keys.GROUPS]
        for worker_id in hosts:
            keys += _host_keys(worker_id, addresses.get(worker_id, ""))
        keys += [redis_keys.group(g.name) for g in groups]
        keys += [redis_keys.LIMITS, redis_keys.LIMITS_USED]
        request = {
            "check": check_limits,
            "hosts": list(hosts),
            "r": [{"h": hosts[p.worker_id], "key": p.attempt_key, "job": p.job_id,
                   **p.need.as_dict(), "kind": p.device_kind, "ports": list(p.ports),
                   "devs": list(p.devices), "u": p.user, "tok": dict(p.tokens),
                   "g": group_index[p.group] if p.group else -1} for p in placements],
            "g": [{"name": g.name, "job": g.job_id, "members": [hosts[m] for m in g.members],
                   "exclusive": g.exclusive} for g in groups],
        }
        return self._reserve, keys, [epoch, msgspec.json.encode(request)]

    async def preempt(self, epoch: int, eviction: Eviction) -> int:
        """One eviction (preempt_many): raises ReservationConflict if Redis refused it;
        returns how many victims it evicted."""
        why = (await self.preempt_many(epoch, [eviction]))[0]
        if why:
            raise ReservationConflict(why)
        return len(eviction.victims)

    async def preempt_many(self, epoch: int, evictions: Sequence[Eviction]) -> list[str]:
        """Evicts each eviction's victims and holds its hosts for its preemptor, all in one
        fenced call, each eviction all or nothing (raises StaleEpochError, writing
        nothing). Returns, per eviction in order, "" if committed, else why Redis refused
        it."""
        if not evictions:
            return []
        hosts: dict[str, int] = {}
        for e in evictions:
            for w in (*e.hosts, *(w for w, _ in e.victims), *e.needs):
                hosts.setdefault(w, len(hosts))
        keys = [redis_keys.EPOCH]
        for worker_id in hosts:
            keys += [redis_keys.host(worker_id), redis_keys.host_allocations(worker_id)]
        request = {"hosts": list(hosts), "evictions": [{
            "job": e.job_id,
            "held": [hosts[w] for w in e.hosts],
            "victims": [{"h": hosts[w], "key": k} for w, k in e.victims],
            "need": [{"h": hosts[w], **n.as_dict()} for w, n in e.needs.items()],
        } for e in evictions]}
        result = await self._fenced(self._preempt, keys, [epoch, msgspec.json.encode(request)])
        if result[0] == "stale_epoch":
            raise StaleEpochError(f"epoch is now {result[1]}")
        return [str(why) for why in result[1:]]

    async def unhold(self, epoch: int, job_id: str, hosts: Sequence[str]) -> int:
        """Lets go of the hosts held for preemptor `job_id`; returns how many it held."""
        if not hosts:
            return 0
        keys = [redis_keys.EPOCH, *(redis_keys.host(w) for w in hosts)]
        return _check(await self._fenced(self._unhold, keys, [epoch, job_id]))

    async def release(self, epoch: int, releases: Sequence[tuple[str, str]],
                      released_through: int = 0) -> int:
        """Releases (worker_id, attempt_key) pairs; returns how many were still held.
        `released_through`: the events sequence through which these are all the releases
        the caller's fold owes (recorded as redis_keys.RELEASED_THROUGH if higher; 0 says
        nothing)."""
        if not releases:
            return 0
        (result,) = await self._fenced_calls([self._release_call(epoch, releases,
                                                                 released_through)])
        return _check(result)

    def _release_call(self, epoch: int, releases: Sequence[tuple[str, str]],
                      released_through: int) -> ScriptCall:
        keys = [redis_keys.EPOCH, redis_keys.GROUPS]
        for worker_id, _ in releases:
            keys += [redis_keys.host(worker_id), redis_keys.host_allocations(worker_id)]
        keys += [redis_keys.LIMITS_USED, redis_keys.RELEASED_THROUGH]
        return self._release, keys, [epoch, released_through, *(key for _, key in releases)]

    async def usage(self) -> tuple[list[HostUsage], list[GroupUsage]]:
        """Every host's capacity and reservations and every group claim (for reconciliation
        and checks), read in one MULTI: a commit landing between two reads would otherwise
        look like a disagreement, e.g. between a host's counters and its reservations."""
        snapshot = await self.snapshot()
        return snapshot.hosts, snapshot.groups

    async def snapshot(self) -> UsageSnapshot:
        """usage(), with the limits-use hash and RELEASED_THROUGH read in the same MULTI
        (the checker compares the counters with the reservations, and tells an owed
        release from a leak)."""
        # The client decodes responses (redis_io.connect), so every value here is a str.
        hosts: set[str] = await self.client.smembers(redis_keys.HOSTS)  # type: ignore[assignment]
        groups: set[str] = await self.client.smembers(redis_keys.GROUPS)  # type: ignore[assignment]
        worker_ids, group_keys = sorted(hosts), sorted(groups)
        async with self.client.pipeline(transaction=True) as pipe:
            for worker_id in worker_ids:
                pipe.hgetall(redis_keys.host(worker_id))
                pipe.hgetall(redis_keys.host_allocations(worker_id))
            for key in group_keys:
                pipe.hgetall(key)
            pipe.hgetall(redis_keys.LIMITS_USED)
            pipe.get(redis_keys.RELEASED_THROUGH)
            replies: list[Any] = await pipe.execute()
        released_through = int(replies.pop() or 0)
        limits_used: dict[str, str] = replies.pop()
        host_usage: list[HostUsage] = []
        for n, worker_id in enumerate(worker_ids):
            h, allocs = replies[2 * n:2 * n + 2]
            host_usage.append(HostUsage(
                worker_id=worker_id,
                capacity=_amounts(h, "cap"),
                used=_amounts(h, "used"),
                device_kind=h.get("dev_kind", ""),
                gang=h.get("gang"),
                allocations={key: _allocation(raw) for key, raw in allocs.items()},
                held_for=h.get("held_for"),
            ))
        group_usage: list[GroupUsage] = []
        for key, g in zip(group_keys, replies[2 * len(worker_ids):], strict=True):
            if not g:
                continue  # released since the set was read
            members = json.loads(g.get("members", "[]")) or []
            group_usage.append(GroupUsage(
                name=g.get("name", _group_name_of_key(key)), owner=g.get("owner", ""),
                members=tuple(_worker_of_host_key(m) for m in members),
                exclusive=g.get("exclusive") == "1", live=int(g.get("live", 0)),
            ))
        return UsageSnapshot(host_usage, group_usage, limits_used, released_through)

    async def host_usage(self) -> list[HostUsage]:
        return (await self.usage())[0]

    async def group_usage(self) -> list[GroupUsage]:
        return (await self.usage())[1]

    async def count_refused_double_booking(self) -> None:
        """A counter, not state: written unfenced so a refused commit is always counted."""
        await self.client.hincrby(redis_keys.METRICS, "refused_double_bookings", 1)

    async def refused_double_bookings(self) -> int:
        raw = await self.client.hget(redis_keys.METRICS, "refused_double_bookings")
        return int(raw or 0)


def _amounts(h: dict[str, str], suffix: str) -> Amounts:
    return Amounts(*(int(h.get(f"{d}_{suffix}", 0)) for d in ("cpu", "mem", "disk", "dev")))


def _allocation(raw: str) -> Allocation:
    a = json.loads(raw)
    ports = a.get("ports") or []  # Lua's cjson encodes an empty list as {}
    devices = a.get("devs") or []
    return Allocation(
        job_id=a["job"], need=Amounts(a["cpu"], a["mem"], a["disk"], a["dev"]),
        ports=tuple(int(p) for p in ports) if isinstance(ports, list) else (),
        group=_group_name_of_key(a["group"]) if a.get("group") else "",
        address=str(a.get("pk", "")).removeprefix(redis_keys.address_ports("")),
        devices=tuple(int(d) for d in devices) if isinstance(devices, list) else (),
        user=a.get("u"),
        # Lua's cjson encodes an empty dict as {} and an empty table read back the same.
        tokens=tuple(sorted((str(k), int(v)) for k, v in (a.get("tok") or {}).items()))
        if isinstance(a.get("tok"), dict) else (),
    )
