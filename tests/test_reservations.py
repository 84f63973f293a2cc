"""The Lua scripts against a real Redis-compatible server: atomic, all-or-nothing, fenced."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared import redis_io
from shared.reservations import (
    Reservation,
    ReservationConflict,
    ReservationStore,
    StaleEpochError,
)


@pytest.fixture
async def store(clean_servers) -> AsyncIterator[ReservationStore]:
    client = redis_io.connect(clean_servers[1].url)
    yield ReservationStore(client)
    await client.aclose()


async def test_lease_gives_increasing_epochs_and_one_holder(store: ReservationStore) -> None:
    first = await store.acquire_lease("a", 60_000)
    assert first >= 1
    assert await store.acquire_lease("a", 60_000) == first  # renewal keeps the epoch
    assert await store.acquire_lease("b", 60_000) == 0  # held by a
    await store.client.delete("berth:leader")  # the lease expires
    second = await store.acquire_lease("b", 60_000)
    assert second == first + 1


async def test_reserve_is_all_or_nothing(store: ReservationStore) -> None:
    epoch = await store.acquire_lease("a", 60_000)
    await store.register_host(epoch, "h1", 2000, 1000)
    await store.register_host(epoch, "h2", 1000, 1000)
    with pytest.raises(ReservationConflict, match="over capacity on berth:host:h2"):
        await store.reserve(epoch, [Reservation("h1", "j/0/0", 1000, 100),
                                    Reservation("h2", "j/1/0", 600, 100),
                                    Reservation("h2", "j/2/0", 600, 100)])
    usage = {u.worker_id: u for u in await store.host_usage()}
    assert usage["h1"].cpu_used == 0 and usage["h1"].allocations == {}
    await store.reserve(epoch, [Reservation("h1", "j/0/0", 1000, 100),
                                Reservation("h2", "j/1/0", 1000, 100)])
    usage = {u.worker_id: u for u in await store.host_usage()}
    assert usage["h1"].allocations == {"j/0/0": (1000, 100)}
    assert usage["h2"].cpu_used == 1000
    with pytest.raises(ReservationConflict, match="already reserved"):
        await store.reserve(epoch, [Reservation("h1", "j/0/0", 1, 1)])
    with pytest.raises(ReservationConflict, match="unknown host"):
        await store.reserve(epoch, [Reservation("nope", "j/9/0", 1, 1)])


async def test_release_is_idempotent(store: ReservationStore) -> None:
    epoch = await store.acquire_lease("a", 60_000)
    await store.register_host(epoch, "h1", 2000, 1000)
    await store.reserve(epoch, [Reservation("h1", "j/0/0", 1500, 100)])
    assert await store.release(epoch, [("h1", "j/0/0")]) == 1
    assert await store.release(epoch, [("h1", "j/0/0")]) == 0
    (usage,) = await store.host_usage()
    assert (usage.cpu_used, usage.mem_used, usage.allocations) == (0, 0, {})


async def test_a_deposed_leader_cannot_write(store: ReservationStore) -> None:
    old = await store.acquire_lease("a", 60_000)
    await store.register_host(old, "h1", 2000, 1000)
    await store.client.delete("berth:leader")
    new = await store.acquire_lease("b", 60_000)
    assert new > old
    with pytest.raises(StaleEpochError):
        await store.reserve(old, [Reservation("h1", "j/0/0", 1000, 100)])
    with pytest.raises(StaleEpochError):
        await store.release(old, [("h1", "j/0/0")])
    with pytest.raises(StaleEpochError):
        await store.register_host(old, "h1", 99999, 99999)
    (usage,) = await store.host_usage()
    assert usage.cpu_cap == 2000 and usage.allocations == {}
