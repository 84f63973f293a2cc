"""shared/pull_fetch.py against a real nats-server: the batches nats-py's fetch would give,
without a timed wait per message, and with the data messages taken in the client's read
loop (`PullReader` given `make`)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from berth.shared import nats_io, pull_fetch, subjects
from berth.shared.nats_io import stored_ns, stream_seq
from tests.test_follow_take import count_nats_py_data_messages
from tests.test_projection import publish_events

Item = tuple[int, str]  # stream sequence, the message's dedup id


def item_of_msg(msg: Msg) -> Item:
    return stream_seq(msg), (msg.headers or {})["Nats-Msg-Id"]


def item_taken(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> Item:
    assert headers is not None
    return int(reply.split(b".")[5]), nats_io.WireHeaders(headers)["Nats-Msg-Id"]


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


async def test_a_readers_data_messages_are_taken_in_the_read_loop_in_the_same_batches(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    assert nats_io.TAKES_STREAMS and isinstance(nc, nats_io.Client)
    await publish_events(nc, 23)
    by_nats_py = count_nats_py_data_messages(monkeypatch)
    sub = await pull(nc, "take-test")
    reader = pull_fetch.PullReader(sub, item_of_msg, item_taken)  # type: ignore[arg-type]
    assert reader.taking
    seen: list[Item] = []
    while len(seen) < 23:
        batch = await reader.fetch(10, 1.0)
        assert 1 <= len(batch) <= 10
        seen += batch
    assert seen == [(n, f"test-{n}") for n in range(1, 24)]
    assert by_nats_py == []  # no `Msg` made, no queue

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await reader.fetch(10, 0.3)
    assert time.monotonic() - started >= 0.25

    waiting = asyncio.create_task(reader.fetch(1000, 10.0))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await publish_events(nc, 1, first_epoch=24)
    assert await asyncio.wait_for(waiting, 5.0) == [(24, "test-24")]
    assert time.monotonic() - started < 2.0

    reader.close()
    await sub.unsubscribe()  # type: ignore[attr-defined]
    assert not nc._pulls


async def test_messages_the_taker_refuses_are_queued_and_none_overtakes_them(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message refused goes to nats-py's queue; every later one must queue behind it until
    the reader has read it, or the batches would come out of order."""
    await publish_events(nc, 40)
    by_nats_py = count_nats_py_data_messages(monkeypatch)

    def every_seventh_refused(subject: bytes, reply: bytes, data: bytes,
                              headers: bytes | None) -> Item | None:
        item = item_taken(subject, reply, data, headers)
        return None if item[0] % 7 == 0 else item

    sub = await pull(nc, "refuse-test")
    reader = pull_fetch.PullReader(sub, item_of_msg, every_seventh_refused)  # type: ignore[arg-type]
    seen: list[Item] = []
    while len(seen) < 40:
        seen += await reader.fetch(8, 1.0)
    assert seen == [(n, f"test-{n}") for n in range(1, 41)]
    assert by_nats_py  # some went through nats-py's queue
    assert len(by_nats_py) < 40  # and some did not


async def test_an_unsubscribed_pull_is_let_go_by_the_client(nc: NATS) -> None:
    assert isinstance(nc, nats_io.Client)
    await publish_events(nc, 2)
    sub = await pull(nc, "let-go-test")
    reader = pull_fetch.PullReader(sub, item_of_msg, item_taken)  # type: ignore[arg-type]
    assert await reader.fetch(10, 1.0) == [(1, "test-1"), (2, "test-2")]
    assert len(nc._pulls) == 1
    await sub.unsubscribe()  # type: ignore[attr-defined]
    assert not nc._pulls


async def test_without_the_internals_messages_come_through_nats_pys_queue(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nats_io, "TAKES_STREAMS", False)
    await publish_events(nc, 12)
    by_nats_py = count_nats_py_data_messages(monkeypatch)
    sub = await pull(nc, "queue-test")
    reader = pull_fetch.PullReader(sub, item_of_msg, item_taken)  # type: ignore[arg-type]
    assert not reader.taking
    seen: list[Item] = []
    while len(seen) < 12:
        seen += await reader.fetch(5, 1.0)
    assert seen == [(n, f"test-{n}") for n in range(1, 13)]
    assert len(by_nats_py) == 12


async def test_a_subscription_without_the_members_read_here_uses_nats_pys_fetch(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull_fetch, "_internals", lambda psub: None)
    await publish_events(nc, 7)
    sub = await pull(nc, "plain-test")
    reader = pull_fetch.PullReader(sub, item_of_msg, item_taken)  # type: ignore[arg-type]
    assert not reader.taking
    assert await reader.fetch(10, 1.0) == [(n, f"test-{n}") for n in range(1, 8)]
    await publish_events(nc, 3, first_epoch=8)
    batch = await pull_fetch.fetch(sub, 10, 1.0)  # type: ignore[arg-type]
    assert [stream_seq(m) for m in batch] == [8, 9, 10]
    with pytest.raises(TimeoutError):
        await pull_fetch.fetch(sub, 10, 0.2)  # type: ignore[arg-type]
