"""nats_io.subscribe_now (a handler called in the reading task), against a real nats-server:
every message arrives, in order, a few at a time or thousands a second."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from berth.shared import nats_io, servers
from tests.conftest import admin_connect, wait_until


async def test_messages_reach_the_handler_in_order_and_a_failing_one_stops_nothing(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        caplog: pytest.LogCaptureFixture) -> None:
    assert isinstance(nc, nats_io.Client)
    got: list[tuple[str, str, bytes]] = []

    def handler(msg: Msg) -> None:
        if msg.data == b"boom":
            raise ValueError("a handler's bug")
        got.append((msg.subject, msg.reply, msg.data))

    sub = await nats_io.subscribe_now(nc, "now.*", handler)
    await nc.flush()
    publisher = await admin_connect(clean_servers[0])
    try:
        for i in range(300):
            await publisher.publish(f"now.{i % 3}", b"boom" if i == 7 else b"%d" % i,
                                    reply="back" if i % 2 else "")
        await publisher.flush()
        await wait_until(lambda: len(got) == 299)
        assert [data for _, _, data in got] == [b"%d" % i for i in range(300) if i != 7]
        assert got[0] == ("now.0", "", b"0") and got[1] == ("now.1", "back", b"1")
        assert "the handler of a message on now.1 failed" in caplog.text
        # Unsubscribed: nothing more reaches it, and the client lets go of it.
        await sub.unsubscribe()
        assert sub._id not in nc._handlers
        await publisher.publish("now.0", b"late")
        await publisher.flush()
        await nc.flush()
        await asyncio.sleep(0.1)
        assert len(got) == 299
    finally:
        await publisher.close()


async def test_a_busy_spell_arrives_whole_and_in_order(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer]) -> None:
    assert isinstance(nc, nats_io.Client)
    got: list[int] = []
    sub = await nats_io.subscribe_now(nc, "busy", lambda msg: got.append(int(msg.data)))
    await nc.flush()
    publisher = await admin_connect(clean_servers[0])
    count = 12_000
    try:
        # Thousands a second, a few at a time.
        for i in range(0, count, 12):
            for j in range(i, i + 12):
                await publisher.publish("busy", b"%d" % j)
            await publisher.flush()
            await asyncio.sleep(0.001)
        await wait_until(lambda: len(got) == count)
        assert got == list(range(count))
    finally:
        await sub.unsubscribe()
        await publisher.close()


async def test_on_a_plain_nats_py_client_the_handler_runs_from_a_callback(
        clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        caplog: pytest.LogCaptureFixture) -> None:
    server = clean_servers[0]
    creds = server.admin_creds()
    plain = await nats.connect(server.url, **nats_io.auth_options(creds))
    got: list[bytes] = []
    try:
        await nats_io.subscribe_now(plain, "plain", lambda msg: got.append(msg.data))
        await plain.publish("plain", b"x")
        await wait_until(lambda: got == [b"x"])
    finally:
        await plain.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
