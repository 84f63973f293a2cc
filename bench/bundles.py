"""Workspace bundles on the embedded stack: upload, first build, cached start, fan-out.

Starts a fresh stack (real services, N real workers) in a temporary directory and a tree of
incompressible files, then measures:

- pack + upload of the tree (the same tree again: pack + "already stored");
- submit -> RUNNING of a 1-task job without a bundle (the baseline), with the bundle on a
  worker that has not fetched it (first build: fetch + unpack), and again (cached: the
  cached tree given to a new task directory), interleaved with the baseline: best and
  median of --repeat each;
- that cached start's own work alone: placing the cached tree in a new directory, against
  unpacking the tar there (what a cached start did before);
- one job of T tasks over the N workers needing a bundle none has: submit -> every task
  RUNNING (and until the first task was), the CPU seconds the stack spent on it, how many
  fetches the workers made (each should fetch it once) and, from their log lines, where
  each fetch's time went: when it started after the submit, until its first chunk,
  receiving, and the unpack's catching up after the last chunk. The same job without a
  bundle is the baseline.

On a shared machine the load average (printed) moves the wall-clock figures a lot; the CPU
seconds much less.

    .venv/bin/python bench/bundles.py [--mib 50] [--workers 8] [--tasks 64] [--repeat 7]
                                      [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS

from berth import workspace
from berth.client import publish_submit
from berth.services.worker_agent import bundle_trees
from berth.shared import bundles, nats_io
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import Constraint, JobSpec, Op, Resources, encode
from berth.shared.states import TaskState
from berth.stack import Stack, start_stack

GIVE_UP_AFTER = 120.0


def make_tree(root: Path, mib: float, salt: str) -> None:
    root.mkdir(parents=True)
    (root / "salt.txt").write_text(salt)
    remaining = int(mib * 1024 * 1024)
    i = 0
    while remaining > 0:
        size = min(remaining, 1024 * 1024)
        (root / f"shard-{i:04d}.bin").write_bytes(os.urandom(size))
        remaining -= size
        i += 1


async def upload(nc: NATS, root: Path) -> tuple[str, int, float]:
    started = time.perf_counter()
    with tempfile.TemporaryFile() as archive:
        packed = bundles.pack(root, archive, limit=1 << 40)
        done = await workspace.upload(nc, archive, packed)  # type: ignore[arg-type]
    return done.digest, done.uploaded, time.perf_counter() - started


async def submit_until_running(nc: NATS, state: ClusterState, events: object, spec: JobSpec,
                               first: list[float] | None = None) -> float:
    """Seconds from the publish until every task of the job has reported RUNNING (and in
    `first`, until the first one had)."""
    started = time.perf_counter()
    seq = await publish_submit(nc, encode(spec))
    while True:
        try:
            record = await asyncio.wait_for(anext(events), GIVE_UP_AFTER)  # type: ignore[call-overload]
        except TimeoutError:
            raise SystemExit(f"bench: nothing happened for {GIVE_UP_AFTER:g}s (on a machine "
                             f"this loaded, load average {load_average():.0f}, workers can be "
                             "fenced off: see their logs)") from None
        state.apply(record.seq, record.event)
        job_id = state.job_by_submit.get(seq)
        if job_id is None:
            continue
        tasks = state.jobs[job_id].tasks
        if any(t.state == TaskState.FAILED for t in tasks):
            raise SystemExit(f"bench: a task failed: {[t.error for t in tasks if t.error]}")
        running = [t for t in tasks if t.current_attempt and t.current_attempt.started_at]
        if first is not None and running and not first:
            first.append(time.perf_counter() - started)
        if len(running) == len(tasks):
            return time.perf_counter() - started


def fetch_lines(stack: Stack) -> list[str]:
    """The workers' "fetched bundle ..." log lines (bundle_cache.py), oldest first on each."""
    out = []
    for label in stack.children:
        if label.startswith("local-"):
            for line in (stack.data_dir / "logs" / f"{label}.log").read_text().splitlines():
                if "fetched bundle" in line:
                    out.append(line)
    return out


def fetch_times(stack: Stack) -> list[float]:
    """Seconds each fetch took ("fetched bundle ... in 1.23 s")."""
    return [float(line.split(") in ", 1)[1].split()[0]) for line in fetch_lines(stack)]


def logged_at(line: str) -> float | None:
    """The Unix time of a text log line ("2026-11-23 19:00:00,123 ..."), if it has one."""
    try:
        stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    except ValueError:
        return None
    return stamp.timestamp()


def fetch_breakdown(lines: list[str], submitted: float) -> dict[str, list[float]]:
    """Where each fetch's time went, from its log line: when it started (seconds after the
    submit at Unix time `submitted`), until the first chunk came, from the first chunk to
    the last, and from the last chunk to the tree in place (what the unpack had left to
    do). Sorted, each."""
    out: dict[str, list[float]] = {"started_after_submit_s": [], "first_chunk_s": [],
                                   "receiving_s": [], "unpack_after_last_chunk_s": []}
    for line in lines:
        if "first chunk after " not in line:
            continue  # an older agent's line
        ended = logged_at(line)
        if ended is not None:
            took = float(line.split(") in ", 1)[1].split()[0])
            out["started_after_submit_s"].append(round(ended - took - submitted, 2))
        out["first_chunk_s"].append(float(line.split("first chunk after ")[1].split()[0]))
        out["receiving_s"].append(float(line.split(" in ")[2].split()[0]))
        out["unpack_after_last_chunk_s"].append(float(line.split("unpacked ")[1].split()[0]))
    return {key: sorted(values) for key, values in out.items()}


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU time each of the stack's processes (servers, services, workers with the tasks'
    supervisors they reaped) has used: on a shared machine, what a phase cost whatever the
    load. Workers are summed as "workers"."""
    procs = {**stack.children, **{f"nats{i}": n.proc for i, n in enumerate(stack.nats.nodes)}}
    out: dict[str, float] = {}
    for label, proc in procs.items():
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "workers" if label.startswith("local-") else label
        # utime stime cutime cstime
        out[name] = out.get(name, 0) + sum(int(f) for f in fields[11:15]) / os.sysconf(
            "SC_CLK_TCK")
    return out


def cpu_since(stack: Stack, before: dict[str, float]) -> dict[str, float]:
    now = cpu_seconds(stack)
    spent = {name: round(now[name] - before.get(name, 0), 2) for name in now}
    return {"total": round(sum(spent.values()), 2), **spent}


def load_average() -> float:
    return os.getloadavg()[0]


def place_vs_unpack(tree: Path, tmp: Path) -> tuple[float, float]:
    """Seconds (best of 3) to give a new task directory the bundle from the worker's cache
    (bundle_trees.place) and to unpack its tar there instead (what a cached start did
    before): the cached start's own work, apart from the end-to-end noise."""
    archive = tmp / "place.tar"
    with archive.open("wb") as f:
        bundles.pack(tree, f, limit=1 << 40)
    cached = tmp / "place-cache"
    bundles.unpack(archive, cached)
    bundle_trees.seal(cached)
    placed, unpacked = [], []
    for i in range(3):
        started = time.perf_counter()
        bundle_trees.place(cached, tmp / f"placed-{i}")
        placed.append(time.perf_counter() - started)
        started = time.perf_counter()
        bundles.unpack(archive, tmp / f"unpacked-{i}")
        unpacked.append(time.perf_counter() - started)
    return min(placed), min(unpacked)


async def measure(stack: Stack, tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    nc = await nats_io.connect(stack.nats.url, "berth-bench", stack.nats.admin_creds())
    state = ClusterState()
    events = nats_io.follow_events(nc.jetstream())
    small = Resources(cpu=0.1, memory_mb=16)
    make_tree(tmp / "tree", args.mib, "one")
    digest, sent, upload_s = await upload(nc, tmp / "tree")
    _, sent_again, again_s = await upload(nc, tmp / "tree")
    # On one worker, so the first bundled job fetches and the next ones find it cached.
    one = JobSpec(name="b", command=["sleep", "0.2"], resources=small,
                  constraints=[Constraint(key="id", op=Op.EQ, value="w0")])
    bundled = msgspec.structs.replace(one, bundle=digest)
    base = [await submit_until_running(nc, state, events, one)]
    first = await submit_until_running(nc, state, events, bundled)
    # Interleaved, so that a burst of load elsewhere falls on both kinds alike.
    cached: list[float] = []
    for _ in range(args.repeat):
        base.append(await submit_until_running(nc, state, events, one))
        cached.append(await submit_until_running(nc, state, events, bundled))
    loads = [load_average()]
    place_s, unpack_s = await asyncio.to_thread(place_vs_unpack, tmp / "tree", tmp)
    make_tree(tmp / "tree2", args.mib, "two")
    digest2, _, _ = await upload(nc, tmp / "tree2")
    before = len(fetch_lines(stack))
    fan = JobSpec(name="fan", command=["sleep", "0.2"], replicas=args.tasks,
                  resources=Resources(cpu=round(args.workers * 2 / args.tasks, 3),
                                      memory_mb=16))
    cpu = cpu_seconds(stack)
    fan_base = await submit_until_running(nc, state, events, fan)
    fan_base_cpu = cpu_since(stack, cpu)
    await asyncio.sleep(1)  # those tasks end
    cpu = cpu_seconds(stack)
    first_running: list[float] = []
    submitted = time.time()
    fan_out = await submit_until_running(nc, state, events,
                                         msgspec.structs.replace(fan, bundle=digest2),
                                         first_running)
    fan_out_cpu = cpu_since(stack, cpu)
    fan_lines = fetch_lines(stack)[before:]
    fan_fetches = fetch_times(stack)[before:]
    await events.aclose()
    await nc.close()
    ms = lambda s: round(s * 1000, 1)  # noqa: E731
    return {
        "benchmark": "bundles", "tree_mib": args.mib, "workers": args.workers,
        "tasks": args.tasks,
        "upload_ms": ms(upload_s), "uploaded_bytes": sent,
        "same_tree_again_ms": ms(again_s), "same_tree_again_uploaded_bytes": sent_again,
        "no_bundle_to_running_ms": ms(min(base)),
        "no_bundle_to_running_median_ms": ms(statistics.median(base)),
        "first_build_to_running_ms": ms(first),
        "cached_to_running_ms": ms(min(cached)),
        "cached_to_running_median_ms": ms(statistics.median(cached)),
        "cached_adds_ms": ms(min(cached) - min(base)),
        "cached_adds_median_ms": ms(statistics.median(cached) - statistics.median(base)),
        "cached_place_ms": ms(place_s), "unpack_instead_ms": ms(unpack_s),
        "fan_out_no_bundle_all_running_ms": ms(fan_base),
        "fan_out_all_running_ms": ms(fan_out),
        "fan_out_first_running_ms": ms(first_running[0]) if first_running else None,
        "fan_out_fetches": len(fan_fetches),
        "fan_out_fetch_s": sorted(fan_fetches),
        **{f"fan_out_fetch_{key}": values
           for key, values in fetch_breakdown(fan_lines, submitted).items()},
        # CPU seconds the whole stack used from the submit until every task ran.
        "fan_out_no_bundle_cpu_s": fan_base_cpu,
        "fan_out_cpu_s": fan_out_cpu,
        "load_average": [round(x, 1) for x in [*loads, load_average()]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=50)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7,
                        help="cached starts (and as many without a bundle) to take the best of")
    parser.add_argument("--quick", action="store_true",
                        help="a 2 MiB tree, 2 workers, 8 tasks (for CI)")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.workers, args.tasks, args.repeat = 2, 2, 8, 2
    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp) / "berth", workers=0)
        try:
            for i in range(args.workers):
                stack.start_worker(f"local-{i}", 2, 2048, "-a", f"id=w{i}")
            time.sleep(2)  # let workers register
            result = asyncio.run(measure(stack, Path(tmp), args))
        finally:
            stack.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
