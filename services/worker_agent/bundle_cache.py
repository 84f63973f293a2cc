"""The worker's bundle cache: each bundle fetched from the object store once, unpacked once
as its chunks arrive (bundle_stream.py) into a read-only tree kept on disk by digest (which
task directories then share, see bundle_trees.py), and evicted least recently used first
above a size cap (BERTH_BUNDLE_CACHE_MB). Attempts that need the same bundle at once share
one fetch and one unpack. A fetched bundle is kept only if its bytes hash to its name: the
object store is written by submit users."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from berth.services.worker_agent import bundle_stream, bundle_trees
from berth.shared import bundles, subjects

log = logging.getLogger("berth.worker.bundles")
# A fetch that has received nothing for this long has failed.
STALLED_AFTER = 30.0
# Trees with at most this many files are given to a task directory on the event loop.
PLACE_INLINE_FILES = 256


class BundleUnavailable(Exception):
    """The bundle cannot be had; the message is the attempt's FAILED reason."""


@dataclass
class Received:
    """How a fetch's chunks came (its log line, and bench/bundles.py's breakdown)."""

    started: float  # time.monotonic()
    first: float = 0.0
    last: float = 0.0
    chunks: int = 0
    largest: int = 0

    def chunk(self, size: int) -> None:
        self.last = time.monotonic()
        self.first = self.first or self.last
        self.chunks += 1
        self.largest = max(self.largest, size)

    def describe(self, now: float) -> str:
        if not self.chunks:
            return "no chunks"
        receiving = max(self.last - self.first, 1e-6)
        return (f"first chunk after {self.first - self.started:.2f} s, {self.chunks} chunks "
                f"of up to {bundles.mib(self.largest)} in {receiving:.2f} s "
                f"({self.chunks / receiving:.0f}/s), unpacked "
                f"{now - self.last:.2f} s after the last")


class BundleCache:
    def __init__(self, root: Path, cap_bytes: int, js: JetStreamContext,
                 copies: bool = False) -> None:
        self.root = root
        self.copies = copies  # BERTH_BUNDLE_COPIES
        self.placer = bundle_trees.Placer(copies)
        self.cap_bytes = cap_bytes
        self.js = js
        self.fetching: dict[str, asyncio.Task[Path]] = {}
        self.fetches = 0  # how many were fetched from the object store (benchmarks)
        self.trees: dict[str, bundle_trees.Footprint] = {}  # by the tree's directory name
        # Trees being placed in a task directory right now: never evicted meanwhile.
        self.in_use: collections.Counter[str] = collections.Counter()
        self.warned_root = False

    def tidy(self) -> None:
        """At start: what a previous agent left half done (it died during a fetch or an
        eviction), and bundles an older agent cached as tars; what each tree holds."""
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if ".part-" in entry.name or entry.suffix == ".tar":
                _remove(entry)
            elif entry.is_dir():
                with contextlib.suppress(OSError):
                    self.trees[entry.name] = bundle_trees.footprint(entry)

    def tree(self, digest: str) -> Path:
        return self.root / digest.removeprefix(bundles.DIGEST_PREFIX)

    async def place(self, digest: str, dest: Path) -> None:
        """Gives the task directory `dest` the bundle's files (bundle_trees.place), fetching
        and unpacking it first if this worker has not. Raises BundleUnavailable, OSError."""
        for _ in range(2):
            tree = await self.get(digest)
            self.in_use[tree.name] += 1
            try:
                held = self.trees.get(tree.name)
                if held is not None and held.files <= PLACE_INLINE_FILES and not self.copies:
                    # A few hundred links: quicker here than a thread's hand-off, which on a
                    # busy host costs more than the links themselves.
                    self.placer.place(tree, dest)
                else:
                    await asyncio.to_thread(self.placer.place, tree, dest)
                self._warn_if_root()
                return
            except bundle_trees.TreeChanged as exc:
                # An attempt placing from it at this moment fails ("cannot unpack it") and is
                # retried under its failure budget: rare, and better than sharing the change.
                log.warning("bundle %s: %s; fetching it again", digest, exc)
                await self._drop(tree)
            finally:
                self.in_use[tree.name] -= 1
                if not self.in_use[tree.name]:
                    del self.in_use[tree.name]
        raise BundleUnavailable(f"bundle {digest}: its cached copy keeps being written to")

    def _warn_if_root(self) -> None:
        """Once: tasks run as this agent's user, and read-only files do not stop root."""
        if self.warned_root or not self.placer.shares_files() or os.geteuid() != 0:
            return
        self.warned_root = True
        log.warning("tasks run as root here and share bundled files with the cache by hard "
                    "link: a task that writes one in place changes it for every task of "
                    "this worker (BERTH_BUNDLE_COPIES=1 gives each task its own copies)")

    async def get(self, digest: str) -> Path:
        """The bundle's unpacked, read-only tree, fetched and unpacked if it is not cached.
        Raises BundleUnavailable."""
        tree = self.tree(digest)
        if tree.is_dir():
            with contextlib.suppress(OSError):
                os.utime(tree)  # its last use, for the LRU order
            return tree
        task = self.fetching.get(digest)
        if task is None:
            task = asyncio.create_task(self._fetch(digest, tree))
            self.fetching[digest] = task
            task.add_done_callback(lambda _: self.fetching.pop(digest, None))
        return await asyncio.shield(task)

    async def _fetch(self, digest: str, tree: Path) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        missing = (f"bundle {digest} is not in the object store (bucket "
                   f"{subjects.BUNDLES_BUCKET}): submit it again")
        started = time.monotonic()
        staging = tree.with_name(f"{tree.name}.part-{os.getpid()}.d")
        unpacker: bundle_stream.StreamUnpack | None = None
        try:
            try:
                store = await self.js.object_store(subjects.BUNDLES_BUCKET)
                info = await store.get_info(bundles.object_name(digest))
            except NotFoundError:
                raise BundleUnavailable(missing) from None
            unpacker = bundle_stream.StreamUnpack(staging)
            received = await self._receive(info.nuid or "", info.size or 0, unpacker.feed)
            done = await unpacker.finish()
            unpacker = None
            if bundles.digest_of(done.sha256) != digest:
                raise BundleUnavailable(f"bundle {digest}: the object store's copy does not "
                                        "match its digest")
            if done.error is not None:
                raise done.error
            assert done.held is not None
            held = done.held
            os.replace(staging, tree)
        except BundleUnavailable:
            raise
        except (nats.errors.Error, TimeoutError) as exc:
            raise BundleUnavailable(f"bundle {digest}: cannot fetch it from the object store: "
                                    f"{exc}") from None
        except OSError as exc:
            raise BundleUnavailable(f"bundle {digest}: cannot store it on this worker: "
                                    f"{exc.strerror or exc}") from None
        except Exception as exc:  # tarfile's filter errors: a bundle no packer made
            raise BundleUnavailable(f"bundle {digest}: cannot unpack it: {exc}") from None
        finally:
            if unpacker is not None:
                await unpacker.abort()
            if staging.exists():
                await asyncio.to_thread(_remove, staging)
        self.fetches += 1
        self.trees[tree.name] = held
        now = time.monotonic()
        # bench/bundles.py reads "in <seconds> s" and the fields after it.
        log.info("fetched bundle %s (%s) in %.2f s: %s", digest, bundles.mib(info.size or 0),
                 now - started, received.describe(now))
        await self._evict(keep=tree.name)
        return tree

    async def _receive(self, nuid: str, size: int,
                       feed: Callable[[bytes], Awaitable[None]]) -> Received:
        """The object's chunks handed to `feed` in order as they arrive (an ordered push
        consumer: in the measurements of docs/workspaces.md, pulling them in batches was
        no faster, and nats-py's pull `fetch` costs more per message)."""
        got = Received(time.monotonic())
        if not size:
            return got
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def on_chunk(msg: Msg) -> None:
            if done.done():
                return
            got.chunk(len(msg.data))
            await feed(msg.data)
            if msg.metadata.num_pending == 0:
                done.set_result(None)

        sub = await self.js.subscribe(f"$O.{subjects.BUNDLES_BUCKET}.C.{nuid}", cb=on_chunk,
                                      ordered_consumer=True, stream=subjects.BUNDLES_STREAM)
        try:
            while not done.done():
                await asyncio.wait([done], timeout=1.0)
                last = got.last or got.started
                if not done.done() and time.monotonic() - last > STALLED_AFTER:
                    raise TimeoutError(f"no chunk for {STALLED_AFTER:g}s")
            done.result()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return got

    async def _evict(self, keep: str) -> None:
        """Least recently used first, until the cache fits its cap (the newest always stays,
        and so does a tree being placed). Task directories keep their links to an evicted
        tree's files: its space comes back when they go too."""
        trees = []
        for name, held in self.trees.items():
            with contextlib.suppress(OSError):
                trees.append(((self.root / name).stat().st_mtime, held.bytes, name))
        total = sum(size for _, size, _ in trees)
        for _, size, name in sorted(trees):
            if total <= self.cap_bytes:
                return
            if name != keep and name not in self.in_use:
                await self._drop(self.root / name)
                total -= size
                log.info("evicted bundle %s from the cache", name)

    async def _drop(self, tree: Path) -> None:
        """Out of the cache at once (renamed), then removed from disk off the event loop."""
        self.trees.pop(tree.name, None)
        gone = tree.with_name(f"{tree.name}.part-{os.getpid()}.gone")
        try:
            os.replace(tree, gone)
        except OSError:
            return
        await asyncio.to_thread(_remove, gone)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
