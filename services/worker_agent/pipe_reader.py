"""A pipe's read end, read in the event loop's own callbacks: what the agent needs of
asyncio's StreamReader for a forked supervisor's stdout, stderr and status pipes (`read`,
`readline`, the end of the file), without the file object, transport and protocol asyncio
makes for each pipe. Those cost each attempt's start ~140 µs of the agent's CPU for its
three pipes, more than a quarter of what starting an attempt costs it (docs/performance.md)."""

from __future__ import annotations

import asyncio
import os

# Bytes held unread beyond which the pipe is not read until the caller takes them: a task
# that writes faster than its output is sent blocks on its full pipe, not the agent's memory.
LIMIT = 1 << 20
CHUNK = 1 << 16


class PipeReader:
    def __init__(self, fd: int) -> None:
        """Takes `fd` (closed at the end of the file, or by `close`)."""
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._buffer = bytearray()
        self._ended = False
        self._reading = False
        self._waiter: asyncio.Future[None] | None = None
        os.set_blocking(fd, False)
        self._resume()

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def drained(self) -> bool:
        """At the end of the file, with nothing left to take."""
        return self._ended and not self._buffer

    async def read(self, n: int = CHUNK) -> bytes:
        """Up to `n` bytes, once there are any; b"" at the end of the file."""
        while not self._buffer and not self._ended:
            await self._wait()
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        self._resume()
        return data

    async def readline(self, timeout: float | None = None) -> bytes:
        """The next line with its newline (without one: the last, unfinished); b"" at the
        end of the file. TimeoutError if none came within `timeout` seconds."""
        expired: list[bool] = []
        timer = None
        if timeout is not None:
            timer = self._loop.call_later(timeout, self._expire, expired)
        try:
            while True:
                end = self._buffer.find(b"\n") + 1
                if end or self._ended:
                    end = end or len(self._buffer)
                    line = bytes(self._buffer[:end])
                    del self._buffer[:end]
                    self._resume()
                    return line
                if expired:
                    raise TimeoutError
                await self._wait()
        finally:
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        """Stops reading and closes the pipe; what was read and not taken stays readable."""
        if self._ended:
            return
        self._ended = True
        self._pause()
        os.close(self._fd)
        self._wake()

    def _ready(self) -> None:
        try:
            data = os.read(self._fd, CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        self._buffer += data
        if len(self._buffer) >= LIMIT:
            self._pause()
        self._wake()

    def _resume(self) -> None:
        if not self._reading and not self._ended and len(self._buffer) < LIMIT:
            self._loop.add_reader(self._fd, self._ready)
            self._reading = True

    def _pause(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self, expired: list[bool]) -> None:
        expired.append(True)
        self._wake()
