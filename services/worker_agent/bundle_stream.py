"""A bundle unpacked while its chunks arrive (docs/workspaces.md, "The cache").

The event loop only hands each chunk over (`feed`): no disk and no hashing there, so a
fetch does not hold up the agent's heartbeats and reports. A thread of the fetch's own
takes the chunks in order, hashes every byte and unpacks the tar stream into a staging
directory; the cache renames that into place only once the bytes hash to the bundle's
name. Unpacking before that check is as safe as after it: tarfile's "data" filter, into a
directory nothing uses until then. (A matching digest proves the bytes are the ones named,
not that they are harmless: a submit user can store any tar under its own digest.)

Before this, the fetched tar was written to disk, hashed, read back and unpacked after the
last chunk: two passes over the bundle, one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from berth.services.worker_agent import bundle_trees
from berth.shared import bundles

# Chunks received but not yet unpacked, above which `feed` waits (the disk is slower than
# the network for a while): nats-py then holds the rest, and the consumer's flow control
# the server.
BACKLOG_BYTES = 16 * 1024 * 1024


class _Aborted(Exception):
    pass


@dataclass(frozen=True)
class Unpacked:
    sha256: str  # hex, of every byte fed
    held: bundle_trees.Footprint | None  # the sealed tree's, None if it could not be unpacked
    error: Exception | None  # why not: OSError (the disk), else the tar's fault


class _Chunks:
    """The file-like tarfile reads, over the fed chunks; hashes each as it is taken."""

    def __init__(self, owner: StreamUnpack) -> None:
        self.owner = owner
        self.sha = hashlib.sha256()
        self.view = memoryview(b"")
        self.ended = False

    def read(self, size: int = -1) -> bytes:
        if not self.view and not self._next():
            return b""
        n = len(self.view) if size < 0 else min(size, len(self.view))
        out = bytes(self.view[:n])
        self.view = self.view[n:]
        return out

    def _next(self) -> bool:
        if self.ended:
            return False
        chunk = self.owner.chunks.get()
        if self.owner.aborted:
            raise _Aborted
        if chunk is None:
            self.ended = True
            return False
        self.owner.taken(len(chunk))
        self.sha.update(chunk)
        self.view = memoryview(chunk)
        return True

    def drain(self) -> None:
        """What tarfile left unread (the tar's end padding, or all of it after an error)
        is hashed too: the digest names every byte."""
        self.view = memoryview(b"")
        while self._next():
            pass


class StreamUnpack:
    """Chunks in from the event loop (`feed`, then `finish`); the unpacked, sealed tree in
    `dest` and the bytes' sha256 out. Made on the event loop."""

    def __init__(self, dest: Path, backlog: int = BACKLOG_BYTES) -> None:
        self.dest = dest
        self.backlog = backlog
        self.chunks: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.queued = 0
        self.lock = threading.Lock()  # over `queued` and `full`
        self.full = False  # `feed` waits for `room`
        self.room = asyncio.Event()
        self.aborted = False
        self.loop = asyncio.get_running_loop()
        self.result: asyncio.Future[Unpacked] = self.loop.create_future()
        # Its own thread, not the loop's executor: it waits on the network for as long as
        # the fetch lasts, and the executor's few threads are for short jobs.
        self.thread = threading.Thread(target=self._work, name=f"unpack-{dest.name[:12]}",
                                       daemon=True)
        self.thread.start()

    async def feed(self, chunk: bytes) -> None:
        with self.lock:
            self.queued += len(chunk)
            self.full = self.queued > self.backlog
            if self.full:
                self.room.clear()
        self.chunks.put(chunk)
        if self.full and not self.result.done():
            await self.room.wait()

    def taken(self, size: int) -> None:
        """In the thread: a chunk was taken from the queue."""
        with self.lock:
            self.queued -= size
            if self.full and self.queued <= self.backlog:
                self.full = False
                self._call(self.room.set)

    def _call(self, fn: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self.loop.call_soon_threadsafe(fn)

    async def finish(self) -> Unpacked:
        """After the last chunk: waits for the unpacking to end."""
        self.chunks.put(None)
        return await asyncio.shield(self.result)

    async def abort(self) -> None:
        """Stops the unpacking (the fetch failed) and waits until the thread has let go of
        `dest`, so that it can be removed."""
        self.aborted = True
        self.chunks.put(None)
        with contextlib.suppress(Exception):
            await asyncio.shield(self.result)

    def _work(self) -> None:
        source = _Chunks(self)
        held: bundle_trees.Footprint | None = None
        error: Exception | None = None
        try:
            try:
                bundles.unpack_stream(source, self.dest)  # type: ignore[arg-type]
                held = bundle_trees.seal(self.dest)
            except _Aborted:
                raise
            except Exception as exc:  # tarfile's and its filter's errors, OSError
                error = exc
            source.drain()
        except _Aborted as exc:
            error = exc
        out = Unpacked(source.sha.hexdigest(), held, error)
        self._call(lambda: self._settle(out))

    def _settle(self, out: Unpacked) -> None:
        if not self.result.done():
            self.result.set_result(out)
        self.room.set()
