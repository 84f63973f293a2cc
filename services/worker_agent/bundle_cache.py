"""The worker's bundle cache: each bundle fetched from the object store once, kept on disk
by digest, and evicted least recently used first above a size cap (BERTH_BUNDLE_CACHE_MB).
Attempts that need the same bundle at once share one fetch. A fetched bundle is kept only if
its bytes hash to its name: the object store is written by submit users."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import BinaryIO

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared import bundles, subjects

log = logging.getLogger("berth.worker.bundles")
# A fetch that has received nothing for this long has failed.
STALLED_AFTER = 30.0


class BundleUnavailable(Exception):
    """The bundle cannot be had; the message is the attempt's FAILED reason."""


class BundleCache:
    def __init__(self, root: Path, cap_bytes: int, js: JetStreamContext) -> None:
        self.root = root
        self.cap_bytes = cap_bytes
        self.js = js
        self.fetching: dict[str, asyncio.Task[Path]] = {}
        self.fetches = 0  # how many were fetched from the object store (benchmarks)

    def remove_partial(self) -> None:
        """Fetches a previous agent left half done (it died during them)."""
        for partial in self.root.glob("*.part-*"):
            partial.unlink(missing_ok=True)

    def path(self, digest: str) -> Path:
        return self.root / f"{digest.removeprefix(bundles.DIGEST_PREFIX)}.tar"

    async def get(self, digest: str) -> Path:
        """The bundle's file on disk, fetched if it is not cached. Raises BundleUnavailable."""
        path = self.path(digest)
        if path.exists():
            with contextlib.suppress(OSError):
                os.utime(path)  # its last use, for the LRU order
            return path
        task = self.fetching.get(digest)
        if task is None:
            task = asyncio.create_task(self._fetch(digest, path))
            self.fetching[digest] = task
            task.add_done_callback(lambda _: self.fetching.pop(digest, None))
        return await asyncio.shield(task)

    async def _fetch(self, digest: str, path: Path) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        missing = (f"bundle {digest} is not in the object store (bucket "
                   f"{subjects.BUNDLES_BUCKET}): submit it again")
        started = time.monotonic()
        partial = path.with_suffix(f".part-{os.getpid()}")
        try:
            try:
                store = await self.js.object_store(subjects.BUNDLES_BUCKET)
                info = await store.get_info(bundles.object_name(digest))
            except NotFoundError:
                raise BundleUnavailable(missing) from None
            f = await asyncio.to_thread(partial.open, "wb")
            try:
                sha = await self._receive(info.nuid or "", info.size or 0, f)
            finally:
                f.close()
            if bundles.digest_of(sha) != digest:
                raise BundleUnavailable(f"bundle {digest}: the object store's copy does not "
                                        "match its digest")
            os.replace(partial, path)
        except (nats.errors.Error, TimeoutError) as exc:
            raise BundleUnavailable(f"bundle {digest}: cannot fetch it from the object store: "
                                    f"{exc}") from None
        except OSError as exc:
            raise BundleUnavailable(f"bundle {digest}: cannot store it on this worker: "
                                    f"{exc.strerror or exc}") from None
        finally:
            partial.unlink(missing_ok=True)
        self.fetches += 1
        log.info("fetched bundle %s (%s) in %.2f s", digest, bundles.mib(info.size or 0),
                 time.monotonic() - started)
        self._evict(keep=path)
        return path

    async def _receive(self, nuid: str, size: int, out: BinaryIO) -> str:
        """The object's chunks written to `out` as they arrive; their sha256 (hex).

        nats-py's `ObjectStore.get` hands every chunk to a thread to write, and waits for it
        before taking the next: 50 MiB took 1.4 s that way, 0.5 s written here as they come
        (a 128 KiB write to the page cache does not hold the loop up)."""
        sha = hashlib.sha256()
        if not size:
            return sha.hexdigest()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        last = [time.monotonic()]

        async def on_chunk(msg: Msg) -> None:
            if done.done():
                return
            try:
                out.write(msg.data)
            except OSError as exc:
                done.set_exception(exc)
                return
            sha.update(msg.data)
            last[0] = time.monotonic()
            if msg.metadata.num_pending == 0:
                done.set_result(None)

        sub = await self.js.subscribe(f"$O.{subjects.BUNDLES_BUCKET}.C.{nuid}", cb=on_chunk,
                                      ordered_consumer=True, stream=subjects.BUNDLES_STREAM)
        try:
            while not done.done():
                await asyncio.wait([done], timeout=1.0)
                if not done.done() and time.monotonic() - last[0] > STALLED_AFTER:
                    raise TimeoutError(f"no chunk for {STALLED_AFTER:g}s")
            done.result()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return sha.hexdigest()

    def _evict(self, keep: Path) -> None:
        """Least recently used first, until the cache fits its cap (the newest always stays)."""
        files = []
        for entry in self.root.glob("*.tar"):
            with contextlib.suppress(OSError):
                st = entry.stat()
                files.append((st.st_mtime, st.st_size, entry))
        total = sum(size for _, size, _ in files)
        for _, size, entry in sorted(files):
            if total <= self.cap_bytes:
                return
            if entry != keep:
                entry.unlink(missing_ok=True)
                total -= size
                log.info("evicted bundle %s from the cache", entry.name)
