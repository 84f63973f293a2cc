"""Epochs stay unique when Redis forgets: the lease script takes an epoch above a floor, the
scheduler takes its floor from the event log, fenced writes wait for a replica, and the
retry backoff stays in bounds."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from berth.client import submit_job
from berth.services.scheduler import fencing
from berth.shared import nats_io, redis_auth, redis_io, redis_keys, servers, subjects
from berth.shared.capacity import Amounts
from berth.shared.messages import JobSpec, LeaderElected, Resources
from berth.shared.reservations import NotDurable, ReservationStore
from berth.stack import Stack
from tests.conftest import wait_for_job, wait_until


@pytest.mark.parametrize(("known", "floor"), [
    ((), 0), ((None,), 0), ((None, 4), 4), ((7, 3), 7), ((0, 0), 0), ((2, None, 9), 9)])
def test_the_floor_is_the_highest_known_epoch(known: tuple[int | None, ...], floor: int
                                              ) -> None:
    assert fencing.epoch_floor(*known) == floor


@pytest.mark.parametrize(("epoch", "floor", "fresh"), [
    (1, 0, False), (5, 4, False), (5, 5, True), (4, 5, True), (0, 0, True)])
def test_an_epoch_not_above_the_floor_is_replaced(epoch: int, floor: int, fresh: bool) -> None:
    assert fencing.needs_fresh_epoch(epoch, floor) is fresh


def test_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    backoff = fencing.Backoff(initial=0.2, cap=2.0, rng=random.Random(7))
    delays = [backoff.next() for _ in range(8)]
    ceilings = [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 2.0]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True)), delays
    assert len(set(delays)) == len(delays)  # jittered, not in step
    backoff.reset()
    assert 0.1 <= backoff.next() <= 0.2


@pytest.fixture
async def store(clean_servers: tuple[servers.ServerProcess, servers.RedisServer]
                ) -> AsyncIterator[ReservationStore]:
    client = redis_io.connect(clean_servers[1].url_for(redis_auth.SCHEDULER))
    yield ReservationStore(client)
    await client.aclose()


# (epoch key, lease holder, caller, floor) -> (returned epoch, epoch key, holder after)
LEASE_TABLE = [
    ((None, None, "a", 0), (1, "1", "a:1")),
    (("4", None, "a", 7), (8, "8", "a:8")),  # Redis behind the log: above the log
    (("9", None, "a", 7), (10, "10", "a:10")),  # Redis ahead: the usual increment
    (("5", "a:5", "a", 0), (5, "5", "a:5")),  # renewal keeps the epoch
    (("5", "a:5", "a", 4), (5, "5", "a:5")),
    (("5", "a:5", "a", 5), (6, "6", "a:6")),  # the holder's epoch is in the log: a fresh one
    (("5", "a:5", "a", 8), (9, "9", "a:9")),
    (("6", "a:3", "a", 3), (7, "7", "a:7")),
    (("5", "a:5", "b", 9), (0, "5", "a:5")),  # another holds it: nothing changes
]


@pytest.mark.parametrize(("before", "after"), LEASE_TABLE)
async def test_the_lease_script_takes_an_epoch_above_the_floor(
        store: ReservationStore, before: tuple[str | None, str | None, str, int],
        after: tuple[int, str, str]) -> None:
    epoch_key, holder, caller, floor = before
    if epoch_key is not None:
        await store.client.set(redis_keys.EPOCH, epoch_key)
    if holder is not None:
        await store.client.set(redis_keys.LEADER, holder, px=60_000)
    got = await store.acquire_lease(caller, 60_000, floor)
    assert (got, await store.client.get(redis_keys.EPOCH),
            await store.client.get(redis_keys.LEADER)) == after


async def test_a_write_no_replica_acknowledges_is_not_durable(
        clean_servers: tuple[servers.ServerProcess, servers.RedisServer]) -> None:
    """The session's Redis has no replica: WAIT 1 times out, and the store says so."""
    client = redis_io.connect(clean_servers[1].url_for(redis_auth.SCHEDULER))
    store = ReservationStore(client, wait_replicas=1, wait_timeout=0.05)
    try:
        with pytest.raises(NotDurable, match="0 of 1 replicas acknowledged within 50 ms"):
            await store.acquire_lease("a", 60_000)
        epoch = int(await client.get(redis_keys.EPOCH) or 0)
        with pytest.raises(NotDurable):
            await store.register_host(epoch, "w1", Amounts(1000, 100, 0, 0), "")
    finally:
        await client.aclose()


async def test_a_leader_takes_an_epoch_above_the_newest_in_the_log(
        make_stack, nc: NATS) -> None:
    """Redis has lost its epoch (flushed: as after a failover to a replica that was behind)
    while the log remembers epoch 7: the new leader must not reuse 1..7."""
    await nats_io.publish_event(nc.jetstream(), subjects.LEADER_EVENTS,
                                LeaderElected(scheduler_id="gone", epoch=7), msg_id="leader:7")
    stack: Stack = make_stack(workers=1)
    log = stack.data_dir / "logs" / "scheduler.log"
    await wait_until(lambda: "leading with epoch" in log.read_text(), what="a leader")
    assert "leading with epoch 8:" in log.read_text()
    outcome = await submit_job(nc, JobSpec(name="after", command=["true"],
                                           resources=Resources(cpu=0.5, memory_mb=64)))
    job = await wait_for_job(stack, str(outcome.job_id), {"succeeded"})
    assert job["state"] == "succeeded"
    leaders = [nats_io.raw_event(m).record().event for m in await nats_io.read_subject(
        nc.jetstream(), subjects.EVENTS_STREAM, subjects.LEADER_EVENTS)]
    assert [(e.scheduler_id != "gone", e.epoch) for e in leaders
            if isinstance(e, LeaderElected)] == [(False, 7), (True, 8)]


async def test_a_leader_logged_after_the_floor_was_read_supersedes_this_one(nc: NATS) -> None:
    js = nc.jetstream()
    first = await fencing.announce(js, "a", fencing.Lease(epoch=1, after_seq=0, sent=0.0))
    assert await fencing.newest_leader(js) == (1, first)
    # b read the floor (epoch 1 at `first`), then c was logged before b could announce.
    b = fencing.Lease(epoch=2, after_seq=first, sent=0.0)
    c = await fencing.announce(js, "c", fencing.Lease(epoch=2, after_seq=first, sent=0.0))
    with pytest.raises(fencing.Superseded):
        await fencing.announce(js, "b", b)
    # A retried announcement whose first try was logged (its ack lost) is its own newest.
    assert await fencing.announce(js, "c", fencing.Lease(epoch=2, after_seq=first, sent=0.0)) == c
    assert await fencing.newest_leader(js) == (2, c)
    leaders = [nats_io.raw_event(m).record().event for m in await nats_io.read_subject(
        js, subjects.EVENTS_STREAM, subjects.LEADER_EVENTS)]
    assert [(e.scheduler_id, e.epoch) for e in leaders if isinstance(e, LeaderElected)] == [
        ("a", 1), ("c", 2)]
