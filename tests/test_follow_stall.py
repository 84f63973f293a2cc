"""An event follower whose consumer vanished for good subscribes again, after the last
message it got, on a real nats-server: nothing skipped, nothing twice. A scheduler whose
follower did not placed nothing for minutes while it kept the lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from berth.shared import nats_io, subjects
from tests.test_projection import publish_events


async def take(follower: AsyncGenerator[nats_io.RawEvent], count: int) -> list[int]:
    return [(await asyncio.wait_for(anext(follower), 15)).seq for _ in range(count)]


async def test_a_follower_whose_consumer_is_gone_subscribes_again_after_its_last(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    js = nc.jetstream()
    await publish_events(nc, 3)
    follower = nats_io.follow_raw_events(js, 1, stall_check=0.3)
    try:
        assert await take(follower, 3) == [1, 2, 3]
        # The client's own recovery (a new consumer once idle heartbeats stop) failing, as
        # it did for the stalled leader: only the follower's check is left to notice.
        async def recovery_fails(self: object, sseq: int | None) -> bool:
            return False

        monkeypatch.setattr(JetStreamContext._JSI, "reset_ordered_consumer", recovery_fails)
        for consumer in await js.consumers_info(subjects.EVENTS_STREAM):
            await js.delete_consumer(subjects.EVENTS_STREAM, consumer.name)
        await publish_events(nc, 4, first_epoch=4)
        assert await take(follower, 4) == [4, 5, 6, 7]
        # Following on as before.
        await publish_events(nc, 2, first_epoch=8)
        assert await take(follower, 2) == [8, 9]
    finally:
        await follower.aclose()


async def test_a_quiet_follower_keeps_its_consumer(nc: NATS) -> None:
    """Nothing to deliver is not a stall: the same consumer follows on."""
    js = nc.jetstream()
    await publish_events(nc, 1)
    follower = nats_io.follow_raw_events(js, 1, stall_check=0.2)
    try:
        assert await take(follower, 1) == [1]
        before = {c.name for c in await js.consumers_info(subjects.EVENTS_STREAM)}
        reading = asyncio.create_task(take(follower, 1))
        await asyncio.sleep(1.0)  # a few quiet checks
        assert {c.name for c in await js.consumers_info(subjects.EVENTS_STREAM)} == before
        await publish_events(nc, 1, first_epoch=2)
        assert await reading == [2]
    finally:
        await follower.aclose()
