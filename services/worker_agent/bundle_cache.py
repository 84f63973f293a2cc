"""The worker's bundle cache: each bundle fetched from the object store once, kept on disk
by digest, and evicted least recently used first above a size cap (BERTH_BUNDLE_CACHE_MB).
Attempts that need the same bundle at once share one fetch. A fetched bundle is kept only if
its bytes hash to its name: the object store is written by submit users."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared import bundles, subjects

log = logging.getLogger("berth.worker.bundles")


class BundleUnavailable(Exception):
    """The bundle cannot be had; the message is the attempt's FAILED reason."""


class BundleCache:
    def __init__(self, root: Path, cap_bytes: int, js: JetStreamContext) -> None:
        self.root = root
        self.cap_bytes = cap_bytes
        self.js = js
        self.fetching: dict[str, asyncio.Task[Path]] = {}
        self.fetches = 0  # how many were fetched from the object store (benchmarks)

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
        try:
            store = await self.js.object_store(subjects.BUNDLES_BUCKET)
        except NotFoundError:
            raise BundleUnavailable(missing) from None
        started = time.monotonic()
        partial = path.with_suffix(f".part-{os.getpid()}")
        try:
            f = await asyncio.to_thread(partial.open, "wb")
            try:
                await store.get(bundles.object_name(digest), writeinto=f)
                size = f.tell()
            finally:
                f.close()
            if await asyncio.to_thread(bundles.file_digest, partial) != digest:
                raise BundleUnavailable(f"bundle {digest}: the object store's copy does not "
                                        "match its digest")
            os.replace(partial, path)
        except NotFoundError:
            raise BundleUnavailable(missing) from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise BundleUnavailable(f"bundle {digest}: cannot fetch it from the object store: "
                                    f"{exc}") from None
        except OSError as exc:
            raise BundleUnavailable(f"bundle {digest}: cannot store it on this worker: "
                                    f"{exc.strerror or exc}") from None
        finally:
            partial.unlink(missing_ok=True)
        self.fetches += 1
        log.info("fetched bundle %s (%s) in %.2f s", digest, bundles.mib(size),
                 time.monotonic() - started)
        self._evict(keep=path)
        return path

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
