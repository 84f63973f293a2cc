"""shared/pull_fetch.py against a real nats-server: the batches nats-py's fetch would give,
without a timed wait per message."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from berth.shared import pull_fetch, subjects
from berth.shared.nats_io import stored_ns, stream_seq
from tests.test_projection import publish_events


async def pull(nc: NATS, name: str) -> object:
    js = nc.jetstream()
    await js.add_consumer(subjects.EVENTS_STREAM, ConsumerConfig(
        durable_name=name, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.ALL))
    return await js.pull_subscribe_bind(name, stream=subjects.EVENTS_STREAM)


async def test_every_message_once_in_order_then_a_wait_then_the_newcomer_at_once(
        nc: NATS) -> None:
    await publish_events(nc, 23)
    sub = await pull(nc, "fetch-test")
    seen: list[int] = []
    while len(seen) < 23:
        batch = await pull_fetch.fetch(sub, 10, 1.0)  # type: ignore[arg-type]
        assert 1 <= len(batch) <= 10
        seen += [stream_seq(m) for m in batch]
    assert seen == list(range(1, 24))

    # Nothing left: the fetch waits its `wait`, then says so.
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await pull_fetch.fetch(sub, 10, 0.3)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.25

    # One arrives during a long wait: it is returned without waiting for the batch to fill.
    waiting = asyncio.create_task(pull_fetch.fetch(sub, 1000, 10.0))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await publish_events(nc, 1, first_epoch=24)
    batch = await asyncio.wait_for(waiting, 5.0)
    assert [stream_seq(m) for m in batch] == [24]
    assert time.monotonic() - started < 2.0


async def test_sequence_and_stored_time_read_from_the_reply_as_nats_py_reads_them(
        nc: NATS) -> None:
    """Job ids are derived from the stored time: reading it from the reply subject must
    give exactly what nats-py's metadata gives."""
    await publish_events(nc, 5)
    sub = await pull(nc, "reply-test")
    batch = await pull_fetch.fetch(sub, 10, 1.0)  # type: ignore[arg-type]
    assert len(batch) == 5
    for msg in batch:
        assert stream_seq(msg) == msg.metadata.sequence.stream
        stamp = msg.metadata.timestamp
        assert stamp is not None
        assert stored_ns(msg) == int(stamp.timestamp() * 1e9)
