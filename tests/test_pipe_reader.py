"""PipeReader (services/worker_agent/pipe_reader.py) on real pipes: what the agent reads of a
forked supervisor's stdout, stderr and status pipes."""

from __future__ import annotations

import asyncio
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.worker_agent import pipe_reader
from berth.services.worker_agent.pipe_reader import PipeReader


async def _write_all(fd: int, data: bytes) -> None:
    """Writes `data` into a non-blocking pipe, yielding while it is full."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view[:65536]):]
        except BlockingIOError:
            await asyncio.sleep(0.001)
    os.close(fd)


async def _read_all(reader: PipeReader, n: int) -> bytes:
    out = bytearray()
    while chunk := await reader.read(n):
        assert len(chunk) <= n
        out += chunk
    return bytes(out)


async def _lines(reader: PipeReader) -> list[bytes]:
    out = []
    while line := await reader.readline():
        out.append(line)
    return out


@pytest.mark.parametrize("data, expected", [
    (b"", []),
    (b"123\n", [b"123\n"]),
    (b"123\n{\"cpu_seconds\": 0.1}\n0\n", [b"123\n", b"{\"cpu_seconds\": 0.1}\n", b"0\n"]),
    (b"no newline at the end", [b"no newline at the end"]),
    (b"\n\n", [b"\n", b"\n"]),
])
async def test_readline_gives_each_line_and_the_unfinished_last(
        data: bytes, expected: list[bytes]) -> None:
    r, w = os.pipe()
    reader = PipeReader(r)
    await _write_all(w, data)
    assert await _lines(reader) == expected
    assert reader.ended


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.binary(max_size=3000), max_size=12),
       n=st.integers(min_value=1, max_value=5000))
def test_what_is_read_is_what_was_written(chunks: list[bytes], n: int) -> None:
    async def go() -> tuple[bytes, list[bytes]]:
        data = b"".join(chunks)
        r, w = os.pipe()
        reader = PipeReader(r)
        writer = asyncio.create_task(_write_all(w, data))
        got = await _read_all(reader, n)
        await writer
        r2, w2 = os.pipe()
        lines_reader = PipeReader(r2)
        await _write_all(w2, data)
        return got, await _lines(lines_reader)

    got, lines = asyncio.run(go())
    data = b"".join(chunks)
    assert got == data
    # Newlines only: not str.splitlines' other line ends.
    assert lines == re.findall(rb"[^\n]*\n|[^\n]+$", data)


async def test_a_reader_waits_for_data_and_wakes_when_it_comes() -> None:
    r, w = os.pipe()
    reader = PipeReader(r)
    pending = asyncio.ensure_future(reader.readline())
    await asyncio.sleep(0.02)
    assert not pending.done()  # nothing written yet
    os.write(w, b"4242")
    await asyncio.sleep(0.02)
    assert not pending.done()  # no newline yet
    os.write(w, b"\nrest")
    assert await asyncio.wait_for(pending, 5) == b"4242\n"
    os.close(w)
    assert await reader.read() == b"rest"
    assert await reader.read() == b""


async def test_more_than_the_limit_unread_stops_reading_until_it_is_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A task writing faster than its output is sent fills its pipe and waits; the agent
    holds at most about LIMIT of it."""
    monkeypatch.setattr(pipe_reader, "LIMIT", 100_000)
    r, w = os.pipe()
    reader = PipeReader(r)
    data = os.urandom(1_000_000)
    writer = asyncio.create_task(_write_all(w, data))
    await asyncio.sleep(0.2)
    assert not writer.done()  # the pipe is full: the reader stopped reading
    assert len(reader._buffer) < 100_000 + pipe_reader.CHUNK
    got = await _read_all(reader, 65536)
    await writer
    assert got == data


async def test_close_wakes_a_waiting_reader_and_keeps_what_was_read() -> None:
    r, w = os.pipe()
    reader = PipeReader(r)
    os.write(w, b"partial")
    await asyncio.sleep(0.02)  # read into the buffer
    waiting = asyncio.ensure_future(reader.readline())
    await asyncio.sleep(0.02)
    assert not waiting.done()
    reader.close()
    assert await asyncio.wait_for(waiting, 5) == b"partial"
    assert await reader.read() == b""
    reader.close()  # twice is nothing
    os.close(w)


async def test_readline_gives_up_after_its_timeout_and_keeps_what_came() -> None:
    r, w = os.pipe()
    reader = PipeReader(r)
    os.write(w, b"12")  # not a whole line: a paused writer, say
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await reader.readline(0.1)
    assert 0.08 <= loop.time() - started < 2
    os.write(w, b"34\n")
    assert await reader.readline(5) == b"1234\n"  # in time: nothing was lost
    os.close(w)
    assert await reader.readline(5) == b""
