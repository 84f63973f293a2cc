"""An event follower's messages taken straight from the client's read loop
(`nats_io.Client.take_stream`), on a real nats-server: every message once and in order
when the reader falls behind, when a message goes missing (the ordered consumer starts
again), and with a nats-py whose internals it cannot read (the callback path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from berth.shared import nats_io
from tests.test_projection import publish_events


async def take(follower: AsyncGenerator[nats_io.RawEvent], count: int
               ) -> list[nats_io.RawEvent]:
    return [await asyncio.wait_for(anext(follower), 15) for _ in range(count)]


def count_nats_py_data_messages(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The replies of the data messages nats-py's own `_process_msg` handles from now on."""
    handled: list[bytes] = []
    original = NATS._process_msg

    async def counting(self: NATS, sid: int, subject: bytes, reply: bytes, data: bytes,
                       headers: Any) -> None:
        if reply.startswith(b"$JS.ACK."):
            handled.append(reply)
        await original(self, sid, subject, reply, data, headers)

    monkeypatch.setattr(NATS, "_process_msg", counting)
    return handled


async def test_a_followers_messages_are_taken_in_the_read_loop(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    assert nats_io.TAKES_STREAMS and isinstance(nc, nats_io.Client)
    await publish_events(nc, 1)
    follower = nats_io.follow_raw_events(nc.jetstream(), 1)
    try:
        assert [raw.seq for raw in await take(follower, 1)] == [1]
        by_nats_py = count_nats_py_data_messages(monkeypatch)
        await publish_events(nc, 30, first_epoch=2)
        got = await take(follower, 30)
        assert [raw.seq for raw in got] == list(range(2, 32))
        assert by_nats_py == []
        # Headers are parsed when read, as the client parses them.
        assert isinstance(got[0].headers, nats_io.WireHeaders)
        assert got[0].headers["Nats-Msg-Id"] == "test-2"
        assert dict(got[5].headers)["Nats-Msg-Id"] == "test-7"
    finally:
        await follower.aclose()


@pytest.mark.parametrize("bound", ["messages", "bytes"])
async def test_a_reader_behind_a_full_buffer_gets_the_queued_messages_in_order(
        nc: NATS, monkeypatch: pytest.MonkeyPatch, bound: str) -> None:
    if bound == "messages":
        monkeypatch.setattr(nats_io, "FOLLOW_BUFFER", 3)
    else:
        # These events' payloads are 72-74 bytes: two leave room for a third, not a fourth.
        monkeypatch.setattr(nats_io, "FOLLOW_BUFFER_BYTES", 2 * 74 + 1)
    await publish_events(nc, 1)
    follower = nats_io.follow_raw_events(nc.jetstream(), 1)
    try:
        assert [raw.seq for raw in await take(follower, 1)] == [1]
        by_nats_py = count_nats_py_data_messages(monkeypatch)
        await publish_events(nc, 40, first_epoch=2)
        await asyncio.sleep(0.3)  # all delivered while the reader reads nothing
        assert [raw.seq for raw in await take(follower, 1)] == [2]
        assert len(by_nats_py) >= 30  # queued by nats-py once the buffer was full
        # The buffer has room again, but the queue holds older ones: these queue too.
        await publish_events(nc, 2, first_epoch=42)
        await asyncio.sleep(0.3)
        assert [raw.seq for raw in await take(follower, 41)] == list(range(3, 44))
        # Taken in the read loop again once the queue is empty (as many as fit).
        del by_nats_py[:]
        await publish_events(nc, 3, first_epoch=44)
        assert [raw.seq for raw in await take(follower, 3)] == list(range(44, 47))
        assert by_nats_py == []
    finally:
        await follower.aclose()


async def test_a_message_gone_missing_starts_the_consumer_again_after_the_last_taken(
        nc: NATS) -> None:
    assert isinstance(nc, nats_io.Client)
    await publish_events(nc, 1)
    follower = nats_io.follow_raw_events(nc.jetstream(), 1)
    data_messages = 0
    take_now = nc._take_now

    def losing_the_fifth(sid: int, subject: bytes, reply: bytes, data: bytes,
                         headers: bytes | None) -> bool:
        nonlocal data_messages
        if reply.startswith(b"$JS.ACK."):
            data_messages += 1
            if data_messages == 5:
                return True  # as if it never came: the next one's consumer sequence skips
        return take_now(sid, subject, reply, data, headers)

    try:
        assert [raw.seq for raw in await take(follower, 1)] == [1]
        nc._take_now = losing_the_fifth  # type: ignore[method-assign]
        await publish_events(nc, 20, first_epoch=2)
        assert [raw.seq for raw in await take(follower, 20)] == list(range(2, 22))
        assert data_messages > 20  # delivered again from the lost one on
    finally:
        await follower.aclose()


async def test_without_the_internals_it_reads_follows_through_a_callback(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nats_io, "TAKES_STREAMS", False)
    await publish_events(nc, 10)
    follower = nats_io.follow_raw_events(nc.jetstream(), 3)
    try:
        got = await take(follower, 8)
        assert [raw.seq for raw in got] == list(range(3, 11))
        assert got[0].headers["Nats-Msg-Id"] == "test-3"
        assert isinstance(nc, nats_io.Client) and not nc._streams
    finally:
        await follower.aclose()


@pytest.mark.parametrize(("block", "parsed"), [
    (b"NATS/1.0\r\nNats-Msg-Id: a:1\r\n\r\n", {"Nats-Msg-Id": "a:1"}),
    (b"NATS/1.0\r\nA: b\r\ntraceparent:  00-x-y-01 \r\n\r\n",
     {"A": "b", "traceparent": "00-x-y-01"}),
    (b"NATS/1.0\r\nbad name: x\r\nok: y\r\n\r\n", {"ok": "y"}),
    (b"NATS/1.0\r\n\r\n", {}),
])
def test_wire_headers_read_as_the_client_parses_them(block: bytes,
                                                     parsed: dict[str, str]) -> None:
    headers = nats_io.WireHeaders(block)
    assert headers._parsed is None  # nothing parsed until read
    for name in ("traceparent", "ok", "name", "missing"):  # asked before any parse
        assert (name in nats_io.WireHeaders(block)) == (name in parsed), name
    assert "missing" not in headers and headers._parsed is None  # not there: not parsed
    assert dict(headers) == parsed
    assert len(headers) == len(parsed)
    assert ("ok" in headers) == ("ok" in parsed)
    assert headers.get("missing") is None
    assert dict(headers.items()) == parsed
    assert all(headers.get(name) == value for name, value in parsed.items())
