"""The scheduler's only way to write placement: fenced, atomic Lua calls on Redis.

Every call carries the leader's epoch; a deposed leader's call is refused by the script
(DESIGN.md invariant 4), never half-applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import redis_keys
from shared.redis_io import load_script


class StaleEpochError(Exception):
    """This scheduler's epoch is no longer current: another leader has taken over."""


class ReservationConflict(Exception):
    """Redis disagrees with the scheduler's view (e.g. a host is fuller than it thought)."""


@dataclass(frozen=True)
class Reservation:
    worker_id: str
    attempt_key: str
    cpu_milli: int
    memory_mb: int


@dataclass(frozen=True)
class HostUsage:
    worker_id: str
    cpu_cap: int
    mem_cap: int
    cpu_used: int
    mem_used: int
    allocations: dict[str, tuple[int, int]]


def _host_keys(worker_ids: Sequence[str]) -> list[str]:
    keys = [redis_keys.EPOCH]
    for worker_id in worker_ids:
        keys += [redis_keys.host(worker_id), redis_keys.host_allocations(worker_id)]
    return keys


def _check(result: list[str]) -> int:
    status, detail = result[0], result[1]
    if status == "stale_epoch":
        raise StaleEpochError(f"epoch is now {detail}")
    if status == "conflict":
        raise ReservationConflict(detail)
    return int(detail)


class ReservationStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._reserve = load_script(client, "reserve")
        self._release = load_script(client, "release")
        self._register = load_script(client, "register_host")
        self._lease = load_script(client, "lease")

    async def acquire_lease(self, scheduler_id: str, ttl_ms: int) -> int:
        """Returns this scheduler's epoch while it holds the lease, 0 while another does."""
        keys = [redis_keys.LEADER, redis_keys.EPOCH]
        return int(await self._lease(keys=keys, args=[scheduler_id, ttl_ms]))

    async def register_host(self, epoch: int, worker_id: str, cpu_milli: int, mem_mb: int) -> None:
        keys = [redis_keys.EPOCH, redis_keys.host(worker_id), redis_keys.HOSTS]
        _check(await self._register(keys=keys, args=[epoch, worker_id, cpu_milli, mem_mb]))

    async def reserve(self, epoch: int, placements: Sequence[Reservation]) -> None:
        """Commits all placements or none (raises StaleEpochError / ReservationConflict)."""
        if not placements:
            return
        keys = _host_keys([p.worker_id for p in placements])
        args: list[str | int] = [epoch]
        args += [f"{p.attempt_key},{p.cpu_milli},{p.memory_mb}" for p in placements]
        _check(await self._reserve(keys=keys, args=args))

    async def release(self, epoch: int, releases: Sequence[tuple[str, str]]) -> int:
        """Releases (worker_id, attempt_key) pairs; returns how many were still held."""
        if not releases:
            return 0
        keys = _host_keys([worker_id for worker_id, _ in releases])
        args: list[str | int] = [epoch, *(key for _, key in releases)]
        return _check(await self._release(keys=keys, args=args))

    async def host_usage(self) -> list[HostUsage]:
        """A read of every host's capacity and reservations (for reconciliation and checks)."""
        usage: list[HostUsage] = []
        # The client decodes responses (redis_io.connect), so every value here is a str.
        members: set[str] = await self.client.smembers(redis_keys.HOSTS)  # type: ignore[assignment]
        for worker_id in sorted(members):
            h: dict[str, str] = await self.client.hgetall(  # type: ignore[assignment]
                redis_keys.host(worker_id))
            allocs: dict[str, str] = await self.client.hgetall(  # type: ignore[assignment]
                redis_keys.host_allocations(worker_id))
            parsed = {k: (int(v.split(",")[0]), int(v.split(",")[1])) for k, v in allocs.items()}
            usage.append(
                HostUsage(
                    worker_id=worker_id,
                    cpu_cap=int(h.get("cpu_cap", 0)),
                    mem_cap=int(h.get("mem_cap", 0)),
                    cpu_used=int(h.get("cpu_used", 0)),
                    mem_used=int(h.get("mem_used", 0)),
                    allocations=parsed,
                )
            )
        return usage
