"""The leader's reconcile of Redis with its fold, while the fold goes on (a mid-term one
follows a refused reservation, and reports keep arriving): on a real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from nats.aio.client import Client as NATS
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from berth.services.scheduler import fencing
from berth.services.scheduler.service import Leader
from berth.shared import redis_auth, redis_io, servers
from berth.shared.config import Settings
from berth.shared.messages import attempt_key
from berth.shared.reservations import HostUsage, ReservationStore
from berth.shared.states import TaskState
from tests.test_lifecycle import assigned, registered, report, submitted


@asynccontextmanager
async def leader_on(nc: NATS, redis_server: servers.RedisServer
                    ) -> AsyncIterator[tuple[Leader, ReservationStore, int]]:
    """A leader of a fresh lease on a real Redis (its fold empty), its store and epoch."""
    client = redis_io.connect(redis_server.url_for(redis_auth.SCHEDULER))
    store = ReservationStore(client)
    try:
        epoch = await store.acquire_lease("s1", 60_000)
        yield (Leader(Settings.from_env(), nc, store, "s1",
                      fencing.Lease(epoch=epoch, after_seq=0, sent=time.monotonic())),
               store, epoch)
    finally:
        await client.aclose()


async def running_and_reserved(leader: Leader, store: ReservationStore, epoch: int) -> None:
    """Job j1's task 0 running on w1, its host recorded and its attempt reserved in Redis."""
    for seq, event in enumerate([registered(), submitted(), assigned(0, epoch=epoch),
                                 report(0, TaskState.RUNNING)], start=1):
        leader.state.apply(seq, event)
    leader._register_host(leader.state.workers["w1"])
    await leader._flush_registrations()
    await store.reserve(epoch, [leader._reservation("w1", attempt_key("j1", 0, 0))])


async def test_an_attempt_ending_while_redis_is_read_is_not_reserved_again(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with leader_on(nc, clean_servers[1]) as (leader, store, epoch):
        await running_and_reserved(leader, store, epoch)
        read = store.host_usage

        async def ending_meanwhile() -> list[HostUsage]:
            # The attempt's report is folded while Redis is read, and its release goes out.
            await leader._carry_out(leader.state.apply(5, report(0, TaskState.SUCCEEDED, 0)))
            assert leader.release_task is not None
            await leader.release_task
            return await read()

        monkeypatch.setattr(store, "host_usage", ending_meanwhile)
        await leader._reconcile()
        monkeypatch.setattr(store, "host_usage", read)
        # Before: it was "missing from Redis" and reserved again, for good (nothing would
        # release it: its release had been carried out already).
        assert [list(h.allocations) for h in await store.host_usage()] == [[]]


async def test_releases_say_how_far_they_go_only_once_the_take_over_has_reconciled(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer]) -> None:
    """A take-over's replay carries out no releases; its reconcile releases what the replay
    ended. A release written before that must not claim RELEASED_THROUGH up to the fold,
    or the checker would call the replay's unreleased reservations leaks."""
    async with leader_on(nc, clean_servers[1]) as (leader, store, epoch):
        await running_and_reserved(leader, store, epoch)
        leader.state.apply(5, report(0, TaskState.SUCCEEDED, 0))  # replayed: no effects
        leader.unreleased.append(("w1", attempt_key("j0", 0, 0)))
        await leader._flush_releases()
        snapshot = await store.snapshot()
        assert snapshot.released_through == 0
        assert list(snapshot.hosts[0].allocations) == [attempt_key("j1", 0, 0)]
        await leader._reconcile()
        snapshot = await store.snapshot()
        assert list(snapshot.hosts[0].allocations) == []
        assert snapshot.released_through == 5 and leader.releases_complete


async def test_a_host_whose_registration_is_still_queued_is_recorded_before_a_commit(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer]) -> None:
    """Hosts are recorded in Redis in the background (many per round trip), so a tick may
    place on a host whose registration has not gone out yet: its commit sends it first,
    or reserve.lua would refuse the unknown host."""
    async with leader_on(nc, clean_servers[1]) as (leader, store, _):
        for seq, event in enumerate([registered(), submitted()], start=1):
            leader.state.apply(seq, event)
        held_back = asyncio.get_running_loop().create_future()  # no background flush
        leader.register_task = held_back  # type: ignore[assignment]
        leader._register_host(leader.state.workers["w1"])
        assert await store.host_usage() == []
        assert await leader.tick() == 1
        (usage,) = await store.host_usage()
        assert usage.worker_id == "w1" and list(usage.allocations) == [attempt_key("j1", 0, 0)]
        held_back.cancel()


@pytest.mark.parametrize("failure", [
    RedisConnectionError("Connection refused"),  # the primary gone, before a promotion
    ResponseError("NOREPLICAS Not enough good replicas to write."),
])
async def test_a_release_that_failed_is_retried_without_waiting_for_a_commit(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch, failure: Exception) -> None:
    """An idle leader commits nothing: a failed release left to the next commit held the
    reservations of attempts that ended after a Sentinel failover, as the checker read."""
    async with leader_on(nc, clean_servers[1]) as (leader, store, epoch):
        await running_and_reserved(leader, store, epoch)
        release = store.release
        tries: list[int] = []

        async def failing_twice(epoch: int, releases: list[tuple[str, str]],
                                released_through: int = 0) -> None:
            tries.append(len(releases))
            if len(tries) <= 2:
                raise failure
            await release(epoch, releases, released_through)

        monkeypatch.setattr(store, "release", failing_twice)
        leader.releases_complete = True  # as after a take-over's reconcile
        await leader._carry_out(leader.state.apply(5, report(0, TaskState.SUCCEEDED, 0)))
        assert leader.release_task is not None
        await asyncio.wait_for(leader.release_task, 10)
        assert tries == [1, 1, 1] and leader.unreleased == []
        snapshot = await store.snapshot()
        assert [list(h.allocations) for h in snapshot.hosts] == [[]]
        assert snapshot.released_through == 5  # the fold's, with the release it covers


async def test_a_commit_sends_the_releases_owed_in_its_own_round_trip(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job submitted as another ends (one lone job after another) commits while the end's
    release still waits to be gathered: it goes first in the reserve's pipeline, not in a
    round trip of its own; owed still if the commit fails (test_reservations.py: a
    refused reservation leaves the releases before it written)."""
    async with leader_on(nc, clean_servers[1]) as (leader, store, epoch):
        await running_and_reserved(leader, store, epoch)
        held_back = asyncio.get_running_loop().create_future()  # no background flush
        leader.release_task = held_back  # type: ignore[assignment]
        await leader._carry_out(leader.state.apply(5, report(0, TaskState.SUCCEEDED, 0)))
        owed = [("w1", attempt_key("j1", 0, 0))]
        assert leader.unreleased == owed
        leader.state.apply(6, submitted("j2"))

        async def not_alone(epoch: int, releases: list[tuple[str, str]],
                            released_through: int = 0) -> int:
            raise AssertionError("a release sent in a round trip of its own")

        monkeypatch.setattr(store, "release", not_alone)
        reserve = store.reserve

        async def unreachable(*args: object, **kwargs: object) -> None:
            raise RedisConnectionError("Connection refused")

        monkeypatch.setattr(store, "reserve", unreachable)
        with pytest.raises(RedisConnectionError):
            await leader.tick()
        assert leader.unreleased == owed
        monkeypatch.setattr(store, "reserve", reserve)
        assert await leader.tick() == 1
        assert leader.unreleased == []
        (usage,) = await store.host_usage()
        assert list(usage.allocations) == [attempt_key("j2", 0, 0)]
        held_back.cancel()
