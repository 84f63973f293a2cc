"""The pause after a tick: as long as the tick while the fold has events to fold (so reports
that free capacity and heartbeats get the loop), cut short once it has none (never below
the tick's placing), unless the tick left tasks waiting. On a real nats-server and Redis,
with the tick itself replaced by one that only waits (and a real tick, to say which tasks
it left waiting)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import pytest
from nats.aio.client import Client as NATS

from berth.services.scheduler.service import Leader
from berth.shared import nats_io, servers
from tests.test_follow_stall import take
from tests.test_lifecycle import registered, submitted
from tests.test_projection import publish_events
from tests.test_reconcile import leader_on

TICK = 0.5  # seconds each tick awaits, as a commit's round trips would


async def gaps(leader: Leader, ticks: int, monkeypatch: pytest.MonkeyPatch,
               left_waiting: bool = False, placing: float = 0.0) -> list[float]:
    """Runs the leader's tick loop for `ticks` ticks, each asking for the next at once (as
    jobs arriving during it would), leaving tasks it saw waiting or not, and saying it
    spent `placing` of its seconds placing (its synchronous part); the times from each
    tick's end to the next one's start."""
    spans: list[tuple[float, float]] = []
    done = asyncio.Event()

    async def tick() -> int:
        started = time.monotonic()
        await asyncio.sleep(TICK)
        spans.append((started, time.monotonic()))
        leader.left_waiting = left_waiting
        leader.placing_seconds = placing
        leader.wake.set()
        if len(spans) == ticks:
            done.set()
        return 1

    monkeypatch.setattr(leader, "tick", tick)
    leader.wake.set()
    loop = asyncio.create_task(leader._tick_loop())
    try:
        await asyncio.wait_for(done.wait(), ticks * 2 * TICK + 10)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    return [b[0] - a[1] for a, b in itertools.pairwise(spans)]


async def test_a_fold_with_events_to_fold_gets_a_pause_as_long_as_the_tick(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with leader_on(nc, clean_servers[1]) as (leader, _, _):
        leader.fold_drained.clear()
        assert all(gap >= TICK * 0.95 for gap in await gaps(leader, 3, monkeypatch))


async def test_a_fold_that_has_caught_up_does_not_hold_the_next_tick_back(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with leader_on(nc, clean_servers[1]) as (leader, _, _):
        leader.fold_drained.set()
        assert all(gap < TICK / 2 for gap in await gaps(leader, 3, monkeypatch))


async def test_the_pause_is_never_shorter_than_the_ticks_placing(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At 10,000 hosts a tick of a few tasks still visits every host: without this, such
    ticks held the event loop back to back."""
    async with leader_on(nc, clean_servers[1]) as (leader, _, _):
        leader.fold_drained.set()
        placing = TICK * 0.6
        gaps_seen = await gaps(leader, 3, monkeypatch, placing=placing)
        assert all(placing * 0.95 <= gap < placing + TICK * 0.3 for gap in gaps_seen)


async def test_a_tick_that_left_tasks_waiting_pauses_as_long_as_it_took(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with leader_on(nc, clean_servers[1]) as (leader, _, _):
        leader.fold_drained.set()
        gaps_seen = await gaps(leader, 3, monkeypatch, left_waiting=True)
        assert all(gap >= TICK * 0.95 for gap in gaps_seen)


async def test_the_pause_ends_when_the_fold_catches_up(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with leader_on(nc, clean_servers[1]) as (leader, _, _):
        leader.fold_drained.clear()
        # The fold catches up two fifths of the way into the first pause.
        asyncio.get_running_loop().call_later(TICK * 1.4, leader.fold_drained.set)
        first, second = await gaps(leader, 3, monkeypatch)
        assert TICK * 0.1 <= first < TICK * 0.8
        assert second < TICK / 2


async def test_a_tick_says_whether_it_left_tasks_it_saw_waiting(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer]) -> None:
    async with leader_on(nc, clean_servers[1]) as (leader, _, _):
        for seq, event in enumerate([registered(), submitted("j1", replicas=2)], start=1):
            leader.state.apply(seq, event)  # one worker of 4 cpu, 2 one-cpu tasks
        leader._register_host(leader.state.workers["w1"])
        assert await leader.tick() == 2
        assert not leader.left_waiting
        leader.state.apply(3, submitted("j2", replicas=3))
        assert await leader.tick() == 2  # room for two of three
        assert leader.left_waiting


async def test_the_follower_says_when_its_reader_has_every_message(nc: NATS) -> None:
    await publish_events(nc, 3)
    drained = asyncio.Event()
    follower = nats_io.follow_raw_events(nc.jetstream(), 1, drained=drained)
    try:
        assert await take(follower, 3) == [1, 2, 3]
        assert not drained.is_set()  # the reader has not asked for more: still folding
        reading = asyncio.create_task(take(follower, 1))
        await asyncio.wait_for(drained.wait(), 5)  # asked, and nothing is left
        await publish_events(nc, 1, first_epoch=4)
        assert await reading == [4]
        assert not drained.is_set()  # cleared as the message arrived
    finally:
        await follower.aclose()
