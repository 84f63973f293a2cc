"""How N workers fetching one object store object at once spend their time (issue 14's
fan-out), apart from the rest of the stack: a nats-server, one object of --mib MiB stored
in chunks of each --chunk-kib size, then N processes that each fetch it at the same
moment: with a callback on an ordered push consumer, each chunk written to a file and
hashed on the event loop, the file unpacked after the last chunk (`ordered`, the worker's
way before the streamed unpack), or each chunk handed to a thread that hashes and unpacks
it (`stream`, the worker's way now), or with a pull consumer (`pull`: nats-py's `fetch`,
--batch chunks a request; receiving only). The object is a bundle of --mib MiB of random
files.

Each fetch reports its wall-clock time, its process's CPU seconds, the time to its first
chunk, and how many of the server's flow-control requests nats-py could not answer at once
(it then answers from a task that looks every 0.25 s); nats-server's CPU seconds for the N
fetches come from /proc. Wall-clock time far above the CPU seconds, with no deferred
flow-control answers, is a process waiting for a CPU, not for the server's permission.

    .venv/bin/python bench/bundle_fetch.py [--fetchers 8] [--mib 50] [--chunk-kib 128 1024]
                                           [--how ordered stream pull] [--batch 64] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats.js.client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectMeta, ObjectMetaOptions

from berth.services.worker_agent import bundle_stream, bundle_trees
from berth.shared import bundles, nats_io, servers, subjects
from berth.shared.credentials import AuthDir, Credentials, Role


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:13]) / os.sysconf("SC_CLK_TCK")


async def store(url: str, creds: Credentials, mib: float, chunks: list[int]
                ) -> tuple[dict[int, tuple[str, int]], str]:
    """The same bundle stored once per chunk size: ({chunk size: (nuid, size)}, its
    sha256)."""
    nc = await nats_io.connect(url, "bench-store", creds)
    js = nc.jetstream()
    await nats_io.ensure_streams(js)
    bucket = await js.object_store(subjects.BUNDLES_BUCKET)
    with tempfile.TemporaryDirectory() as tmp:  # a bundle, for --how stream to unpack
        tree = Path(tmp) / "tree"
        tree.mkdir()
        left, i = int(mib * 1024 * 1024), 0
        while left > 0:
            (tree / f"shard-{i:04d}.bin").write_bytes(os.urandom(min(left, 1024 * 1024)))
            left, i = left - 1024 * 1024, i + 1
        archive = io.BytesIO()
        bundles.pack(tree, archive, limit=1 << 40)
        data = archive.getvalue()
    out = {}
    for size in chunks:
        name = f"bench-{size}"
        info = await bucket.put(name, data, meta=ObjectMeta(
            name=name, options=ObjectMetaOptions(max_chunk_size=size)))
        out[size] = (info.nuid or "", info.size or 0)
    await nc.close()
    return out, hashlib.sha256(data).hexdigest()


# nats-py's flow-control answers it could not send at once, in this process.
DEFERRED = [0]


def count_deferred_flow_control() -> None:
    jsi = nats.js.client.JetStreamContext._JSI
    original = jsi.schedule_flow_control_response
    if getattr(original, "counted", False):
        return

    def counted(self: Any, reply: str) -> None:
        DEFERRED[0] += 1
        original(self, reply)

    counted.counted = True  # type: ignore[attr-defined]
    jsi.schedule_flow_control_response = counted  # type: ignore[method-assign]


def unpack_file(archive: str, dest: Path) -> None:
    bundles.unpack(Path(archive), dest)
    bundle_trees.seal(dest)


async def fetch(url: str, creds: Credentials, how: str, batch: int, nuid: str, size: int,
                at: float) -> dict[str, Any]:
    count_deferred_flow_control()
    deferred = DEFERRED[0]
    nc = await nats_io.connect(url, "bench-fetch", creds)
    js = nc.jetstream()
    subject = f"$O.{subjects.BUNDLES_BUCKET}.C.{nuid}"
    await asyncio.sleep(max(0.0, at - time.time()))
    started, cpu = time.perf_counter(), time.process_time()
    sha = hashlib.sha256()
    digest = ""
    got = {"bytes": 0, "chunks": 0, "first": 0.0}
    with tempfile.NamedTemporaryFile() as out:

        def take(data: bytes) -> None:
            got["first"] = got["first"] or time.perf_counter() - started
            out.write(data)
            sha.update(data)
            got["bytes"] += len(data)
            got["chunks"] += 1

        if how in ("ordered", "stream"):
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            unpack = None
            if how == "stream":
                unpack = bundle_stream.StreamUnpack(Path(tempfile.mkdtemp()) / "tree")

            async def on_chunk(msg: Any) -> None:
                if unpack is None:
                    take(msg.data)
                else:  # the worker's way now: hashed and unpacked in a thread
                    got["first"] = got["first"] or time.perf_counter() - started
                    got["bytes"] += len(msg.data)
                    got["chunks"] += 1
                    await unpack.feed(msg.data)
                if msg.metadata.num_pending == 0 and not done.done():
                    done.set_result(None)

            sub = await js.subscribe(subject, cb=on_chunk, ordered_consumer=True,
                                     stream=subjects.BUNDLES_STREAM)
            await done
            await sub.unsubscribe()
            if unpack is None:  # then unpacked from that file, as the worker did
                out.flush()
                where = Path(tempfile.mkdtemp())
                await asyncio.to_thread(unpack_file, out.name, where / "tree")
                shutil.rmtree(where)
            else:
                unpacked = await unpack.finish()
                sha = hashlib.sha256()  # stands for the thread's, which hashed every byte
                digest = unpacked.sha256
                shutil.rmtree(unpack.dest.parent)
        else:
            pull = await js.pull_subscribe(subject, durable=None, stream=subjects.BUNDLES_STREAM,
                                           config=ConsumerConfig(
                                               ack_policy=AckPolicy.NONE,
                                               deliver_policy=DeliverPolicy.ALL,
                                               inactive_threshold=30.0))
            while got["bytes"] < size:
                for msg in await pull.fetch(batch, timeout=30):
                    take(msg.data)
            await pull.unsubscribe()
    result = {"wall_s": round(time.perf_counter() - started, 3),
              "cpu_s": round(time.process_time() - cpu, 3),
              "first_chunk_s": round(got["first"], 3), "chunks": got["chunks"],
              "deferred_flow_control": DEFERRED[0] - deferred,
              "sha256": digest or sha.hexdigest()}
    await nc.close()
    return result


def in_processes(server: servers.ServerProcess, how: str, batch: int, nuid: str, size: int,
                 fetchers: int) -> list[dict[str, Any]]:
    at = time.time() + 1.0  # all start at once, after their imports
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--batch", str(batch), "--child", server.url,
         str(server.auth_dir), how, nuid, str(size), str(at)],
        stdout=subprocess.PIPE, text=True) for _ in range(fetchers)]
    runs = [json.loads(p.communicate()[0] or "null") for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("bench: a fetcher failed (its error is above)")
    return runs


async def in_process(url: str, creds: Credentials, how: str, batch: int, nuid: str,
                     size: int, fetchers: int) -> list[dict[str, Any]]:
    before = DEFERRED[0]
    runs = list(await asyncio.gather(*(fetch(url, creds, how, batch, nuid, size, time.time())
                                       for _ in range(fetchers))))
    for run in runs:  # each saw the others' too
        run["deferred_flow_control"] = 0
    runs[0]["deferred_flow_control"] = DEFERRED[0] - before
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetchers", type=int, default=8)
    parser.add_argument("--mib", type=float, default=50)
    parser.add_argument("--chunk-kib", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--how", nargs="+", choices=["ordered", "pull", "stream"],
                        default=["ordered", "stream", "pull"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--quick", action="store_true",
                        help="2 fetchers of 1 MiB, the push ways only (for CI)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        url, auth_dir, how, nuid, size, at = args.child
        creds = AuthDir(Path(auth_dir)).ensure(Role.ADMIN)
        print(json.dumps(asyncio.run(fetch(url, creds, how, args.batch, nuid, int(size),
                                           float(at)))))
        return
    if args.quick:
        args.fetchers, args.mib, args.chunk_kib, args.how = 2, 1, [128], ["ordered", "stream"]
    chunks = [kib * 1024 for kib in args.chunk_kib]
    with tempfile.TemporaryDirectory() as tmp:
        server = servers.start_nats(Path(tmp))
        try:
            creds = server.admin_creds()
            objects, sha256 = asyncio.run(store(server.url, creds, args.mib, chunks))
            for size in chunks:
                nuid, length = objects[size]
                for how in args.how:
                    before = cpu_of(server.proc.pid)
                    if args.quick:  # in this process: no interpreter to start per fetcher
                        runs = asyncio.run(in_process(server.url, creds, how, args.batch, nuid,
                                                      length, args.fetchers))
                    else:
                        runs = in_processes(server, how, args.batch, nuid, length,
                                            args.fetchers)
                    print(json.dumps({
                        "how": how, "chunk_kib": size // 1024, "fetchers": args.fetchers,
                        "mib": args.mib,
                        "wall_s": sorted(r["wall_s"] for r in runs),
                        "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 3),
                        "first_chunk_s": sorted(r["first_chunk_s"] for r in runs),
                        "chunks": runs[0]["chunks"],
                        "deferred_flow_control": sum(r["deferred_flow_control"] for r in runs),
                        "server_cpu_s": round(cpu_of(server.proc.pid) - before, 2),
                        "intact": all(r["sha256"] == sha256 for r in runs),
                        "load_average": round(os.getloadavg()[0], 1)}), flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
