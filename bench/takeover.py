"""Scheduler take-over with a long history: lease won -> leading, with and without a warm
fold (services/scheduler/warm_fold.py).

Writes N events of realistic history into a real nats-server's events stream (workers
registered, jobs submitted, every task assigned, building, running and succeeded), then,
against it and a real valkey, runs the scheduler's own Leader and WarmFold in this process:

1. cold: a leader with no warm fold (what every take-over did before): folds from sequence 1;
2. a standby follows the stream to its end and saves its snapshot (as it does on stop);
3. 1% more events are written (the tail a restarted scheduler has to fold), then a fresh
   WarmFold loads the snapshot and folds the tail (a restarted scheduler standing by);
4. warm: that standby wins the lease: hand-over, fold to its own leader_elected, reconcile.

    .venv/bin/python bench/takeover.py [--events 1000000] [--skip-cold] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from nats.aio.client import Client as NATS

from berth.services.scheduler import fencing, warm_fold
from berth.services.scheduler.service import Leader
from berth.shared import nats_io, redis_auth, redis_io, servers, subjects
from berth.shared.config import Settings
from berth.shared.messages import (
    AttemptReported,
    JobSpec,
    JobSubmitted,
    Resources,
    TaskAssigned,
    WorkerRegistered,
    encode,
)
from berth.shared.reservations import ReservationStore
from berth.shared.states import TaskState

WORKERS = 100
PER_JOB = 100
EVENTS_PER_TASK = 4  # assigned, building, running, succeeded


def history(first_job: int, jobs: int, workers: bool) -> Iterator[tuple[str, bytes]]:
    """(subject, event) in stream order, each on the subject the fold believes it from."""
    if workers:
        for w in range(WORKERS):
            yield subjects.worker_events(f"w{w}"), encode(WorkerRegistered(
                worker_id=f"w{w}", incarnation="i1", host=f"host{w}", address=f"10.0.0.{w}",
                resources=Resources(cpu=1000, memory_mb=1_000_000)))
    for seq in range(first_job, first_job + jobs):
        job_id = f"j{seq}-{seq % 65536:04x}"
        yield subjects.submit_outcome(None, seq), encode(JobSubmitted(
            job_id=job_id, submit_seq=seq, spec=JobSpec(
                name=f"sweep-{seq}", user=f"user{seq % 7}", replicas=PER_JOB,
                command=["python3", "train.py"], resources=Resources(cpu=1, memory_mb=100))))
        for i in range(PER_JOB):
            worker = f"w{(seq * PER_JOB + i) % WORKERS}"
            yield subjects.task_events(job_id), encode(TaskAssigned(
                job_id=job_id, task_index=i, attempt_id=0, worker_id=worker,
                incarnation="i1", epoch=1))
            for state in (TaskState.BUILDING, TaskState.RUNNING, TaskState.SUCCEEDED):
                yield subjects.attempt_reports(worker), encode(AttemptReported(
                    job_id=job_id, task_index=i, attempt_id=0, worker_id=worker, state=state,
                    exit_code=0 if state == TaskState.SUCCEEDED else None))


async def fill(nc: NATS, events: Iterator[tuple[str, bytes]]) -> int:
    """Publishes `events`; returns the stream's last sequence once it holds them all."""
    js = nc.jetstream()
    before = await nats_io.last_event_seq(js)
    n = 0
    for subject, data in events:
        await nc.publish(subject, data)
        n += 1
        if n % 5000 == 0:
            await nc.flush()
    await nc.flush()
    deadline = time.monotonic() + 300
    while (last := await nats_io.last_event_seq(js)) < before + n:
        if time.monotonic() > deadline:
            raise SystemExit(f"the stream holds {last - before} of {n} events")
        await asyncio.sleep(0.1)
    return last


async def take_over(settings: Settings, nc: NATS, store: ReservationStore, name: str,
                    warm: warm_fold.WarmFold | None) -> tuple[float, int]:
    """Seconds from lease won to leading, and the events the take-over folded."""
    js = nc.jetstream()
    while True:
        lease = await fencing.take_lease(store, js, name, int(settings.lease_ttl * 1000))
        if lease is not None:
            break
        await asyncio.sleep(0.2)  # the last bench leader's lease runs out
    won = time.monotonic()
    state = await warm.hand_over(js) if warm else None
    leader = Leader(settings, nc, store, name, lease, state=state)
    stop = asyncio.Event()
    serving = asyncio.create_task(leader.serve(stop))
    leading = asyncio.create_task(leader.leading.wait())
    await asyncio.wait([serving, leading], return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        serving.result()
        raise SystemExit(f"{name} stopped before leading")
    took = time.monotonic() - won
    stop.set()
    await serving
    return took, leader.folded


async def wait_folded(warm: warm_fold.WarmFold, last: int) -> None:
    while True:
        if warm.state.last_seq >= last:
            return
        await asyncio.sleep(0.01)


async def bench(args: argparse.Namespace, data: Path) -> dict[str, object]:
    nats_server = servers.start_nats(data)
    redis_server = servers.start_redis(data)
    client = redis_io.connect(redis_server.url_for(redis_auth.SCHEDULER))
    nc = await nats_io.connect(nats_server.url, "berth-bench", nats_server.admin_creds())
    try:
        js = nc.jetstream()
        await nats_io.ensure_streams(js)
        store = ReservationStore(client)
        settings = Settings.from_env()
        jobs = max(1, args.events // (PER_JOB * EVENTS_PER_TASK + 1))
        t0 = time.monotonic()
        last = await fill(nc, history(1, jobs, workers=True))
        print(f"wrote {last} events in {time.monotonic() - t0:.1f} s", file=sys.stderr)

        cold: float | None = None
        cold_folded: int | None = None
        if not args.skip_cold:
            cold, cold_folded = await take_over(settings, nc, store, "cold", None)
            print(f"cold take-over: {cold:.2f} s ({cold_folded} events folded)",
                  file=sys.stderr)

        path = data / "scheduler" / "fold.snapshot"
        standby = warm_fold.WarmFold(path, 3600.0)
        t0 = time.monotonic()
        standby.stand_by(js)
        last = await nats_io.last_event_seq(js)
        await wait_folded(standby, last)
        catch_up = time.monotonic() - t0
        t0 = time.monotonic()
        await standby.close()  # saves, as a clean stop does
        saved = time.monotonic() - t0

        tail_jobs = max(1, jobs // 100)
        await fill(nc, history(jobs + 1, tail_jobs, workers=False))
        last = await nats_io.last_event_seq(js)
        restarted = warm_fold.WarmFold(path, 3600.0)
        t0 = time.monotonic()
        restarted.stand_by(js)
        await wait_folded(restarted, last)
        warm_up = time.monotonic() - t0
        warm, warm_folded = await take_over(settings, nc, store, "warm", restarted)
        print(f"warm take-over: {warm:.2f} s ({warm_folded} events folded)", file=sys.stderr)
        return {
            "bench": "takeover",
            "events": last,
            "cold_takeover_s": None if cold is None else round(cold, 3),
            "cold_folded": cold_folded,
            "warm_takeover_s": round(warm, 3),
            "warm_folded": warm_folded,
            "standby_catch_up_s": round(catch_up, 2),
            "standby_events_per_s": round(last / max(catch_up, 1e-9)),
            "snapshot_save_s": round(saved, 2),
            "snapshot_mib": round(path.stat().st_size / 2**20, 1),
            "restart_load_and_tail_s": round(warm_up, 2),
            "tail_events": tail_jobs * (PER_JOB * EVENTS_PER_TASK + 1),
            "cpus": os.cpu_count(),
        }
    finally:
        await nc.close()
        await client.aclose()
        redis_server.stop()
        nats_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="20,000 events (CI)")
    parser.add_argument("--skip-cold", action="store_true",
                        help="no cold take-over (step 1): from 1,000,000 events it folds "
                             "for about 20 minutes of a core")
    args = parser.parse_args()
    if args.quick:
        args.events = 20_000
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="berth-bench-") as tmp:
        report = asyncio.run(bench(args, Path(tmp)))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
