"""Events stream size after N finished one-task jobs, with and without compaction
(docs/retention.md).

Writes the history of N finished jobs into a real nats-server's events stream in rounds
(each job: its submit's outcome, its assignment, three reports, and a pending-reasons
message every ten jobs, each on the subject the fold believes it from), as a cluster that
has run for `--rounds` retention periods. After each round, the scheduler's own Compactor
(services/scheduler/compaction.py; its lease renewal a no-op here, as nothing else leads)
compacts the jobs of every earlier round, from a fold that follows the stream as a
leader's does. The stream's messages and bytes are printed per round, compacted or not.

    .venv/bin/python bench/retention.py [--jobs 100000] [--rounds 10] [--quick]
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
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

from nats.js import JetStreamContext
from procstat import cpu_seconds  # bench/procstat.py, beside this script
from takeover import fill  # bench/takeover.py: the same history writer

from berth.services.scheduler.compaction import Compactor
from berth.shared import nats_io, servers, subjects
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AttemptReported,
    JobsCompacted,
    JobSpec,
    JobSubmitted,
    PendingReason,
    PendingReasonsChanged,
    Resources,
    TaskAssigned,
    WorkerRegistered,
    encode,
)
from berth.shared.states import TaskState

WORKERS = 10
ROUND_SECONDS = 1000.0  # a round's jobs finish at its start; the retention is half of it


def history(first: int, jobs: int, ts: float) -> Iterator[tuple[str, bytes]]:
    for seq in range(first, first + jobs):
        job_id = f"j{seq}-{seq % 65536:04x}"
        worker = f"w{seq % WORKERS}"
        yield subjects.submit_outcome(f"user{seq % 7}", seq), encode(JobSubmitted(
            job_id=job_id, submit_seq=seq, ts=ts, spec=JobSpec(
                name=f"job-{seq}", user=f"user{seq % 7}", command=["python3", "train.py"],
                resources=Resources(cpu=1, memory_mb=100))))
        yield subjects.task_events(job_id), encode(TaskAssigned(
            job_id=job_id, task_index=0, attempt_id=0, worker_id=worker, incarnation="i1",
            epoch=1, ts=ts))
        for state in (TaskState.BUILDING, TaskState.RUNNING, TaskState.SUCCEEDED):
            yield subjects.attempt_reports(worker), encode(AttemptReported(
                job_id=job_id, task_index=0, attempt_id=0, worker_id=worker, state=state,
                exit_code=0 if state == TaskState.SUCCEEDED else None, ts=ts))
        if seq % 10 == 0:
            yield subjects.PENDING_REASONS, encode(PendingReasonsChanged(
                reasons=[PendingReason(job_id=job_id, task_index=0, reason="waiting")],
                epoch=1, ts=ts))


async def fold_to_tail(js: JetStreamContext, state: ClusterState,
                       follower: AsyncGenerator[nats_io.EventRecord]) -> None:
    last = await nats_io.last_event_seq(js)
    while state.last_seq < last:
        record = await anext(follower)
        state.apply(record.seq, record.event)


async def stream_size(js: JetStreamContext) -> tuple[int, int]:
    info = await js.stream_info(subjects.EVENTS_STREAM)
    return info.state.messages, info.state.bytes


async def bench(args: argparse.Namespace, data: Path) -> dict[str, object]:
    """One stream, compacted after each round. What it would hold uncompacted is counted
    alongside: each round adds the same messages either way (the compaction records are
    written after the round's size is taken), so it is the sum of what the rounds added."""
    nats_server = servers.start_nats(data)
    nc = await nats_io.connect(nats_server.url, "berth-bench", nats_server.admin_creds())
    try:
        js = nc.jetstream()
        await nats_io.ensure_streams(js)
        await fill(nc, ((subjects.worker_events(f"w{w}"), encode(WorkerRegistered(
            worker_id=f"w{w}", incarnation="i1", resources=Resources(cpu=1000, memory_mb=10**6))))
            for w in range(WORKERS)))
        state = ClusterState()
        follower = nats_io.follow_events(js, 1)

        async def renew() -> None:
            pass  # nothing else leads here

        async def apply(event: JobsCompacted) -> None:
            state.apply(0, event)

        compactor = Compactor(js, lambda: state, 1, renew, apply)
        per_round = args.jobs // args.rounds
        rows: list[dict[str, object]] = []
        kept_messages, kept_bytes = await stream_size(js)
        seconds = cpu = 0.0
        server_pid = nats_server.proc.pid
        for r in range(args.rounds):
            messages, size = await stream_size(js)
            await fill(nc, history(1 + r * per_round, per_round, r * ROUND_SECONDS))
            await fold_to_tail(js, state, follower)
            added_messages, added_bytes = await stream_size(js)
            kept_messages += added_messages - messages
            kept_bytes += added_bytes - size
            t0, cpu0 = time.monotonic(), time.process_time() + cpu_seconds(server_pid)
            reply = await compactor.compact(ROUND_SECONDS / 2, now=r * ROUND_SECONDS)
            seconds += time.monotonic() - t0
            cpu += time.process_time() + cpu_seconds(server_pid) - cpu0
            await fold_to_tail(js, state, follower)
            messages, size = await stream_size(js)
            rows.append({"finished_jobs": (r + 1) * per_round, "compacted_jobs": reply.jobs,
                         "kept_messages": kept_messages, "kept_bytes": kept_bytes,
                         "messages": messages, "bytes": size, "folded_jobs": len(state.jobs)})
            print(f"{(r + 1) * per_round:>9} finished jobs: kept {kept_messages:>9} msgs "
                  f"{kept_bytes:>11} B | compacted {messages:>8} msgs {size:>10} B",
                  file=sys.stderr)
        await follower.aclose()
        compacted = sum(int(str(row["compacted_jobs"])) for row in rows)
        return {"bench": "retention", "jobs": args.jobs, "rounds": args.rounds, "rows": rows,
                "compaction_s": round(seconds, 2),
                "compaction_ms_per_job": round(1000 * seconds / max(compacted, 1), 3),
                # CPU of the compacting process (the leader's part) and of nats-server.
                "compaction_cpu_ms_per_job": round(1000 * cpu / max(compacted, 1), 3),
                "cpus": os.cpu_count()}
    finally:
        await nc.close()
        nats_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="400 jobs in 4 rounds (CI)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.rounds = 400, 4
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="berth-bench-") as tmp:
        report = asyncio.run(bench(args, Path(tmp)))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
