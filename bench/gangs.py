"""Gang placement on the embedded stack with real worker processes.

1. Latency: one 32-host slice (32 worker agents, `tpu-name=big`); N 32-task gangs, one after
   another; each timed from the JetStream publish until the fold of the events stream shows
   all 32 tasks ASSIGNED (the placement committed in Redis and logged), and until all 32 are
   RUNNING (every worker started its process).
2. Stress: the same 32 workers also form 4 groups of 8 (`sub=s0..s3`); M 8-task gangs are
   submitted at once and run to completion, then the checker (what `berth doctor` runs)
   reads Redis and the log.

    .venv/bin/python bench/gangs.py [--latency-gangs 20] [--stress-gangs 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from berth.client import publish_submit
from berth.shared import nats_io, redis_auth, redis_io
from berth.shared.checker import check_cluster
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import Coscheduling, JobSpec, Resources, TpuDevice, encode
from berth.shared.reservations import ReservationStore
from berth.shared.states import JOB_TERMINAL, TaskState
from berth.stack import Stack, start_stack

HOSTS = 32
SUB = 8


def gang(name: str, replicas: int, group_by: str, command: list[str]) -> bytes:
    return encode(JobSpec(
        name=name, replicas=replicas, command=command,
        resources=Resources(cpu=0.05, memory_mb=16,
                            device=TpuDevice(variant="v5p", topology="2x2x1", count=4)),
        coscheduling=Coscheduling(group_by=group_by, order_by="tpu-worker-id"),
        ports=["coordinator"],
    ))


def count(state: ClusterState, job_id: str, states: set[TaskState]) -> int:
    return sum(1 for t in state.jobs[job_id].tasks if t.state in states)


async def latency(stack: Stack, gangs: int) -> dict[str, float]:
    nc = await nats_io.connect(stack.nats.url, "berth-bench", stack.nats.admin_creds())
    state = ClusterState()
    events = nats_io.follow_events(nc.jetstream())
    placed: list[float] = []
    running: list[float] = []
    spec = gang("lat", HOSTS, "tpu-name", ["true"])
    live = {TaskState.ASSIGNED, TaskState.BUILDING, TaskState.RUNNING, TaskState.SUCCEEDED}
    started_states = {TaskState.RUNNING, TaskState.SUCCEEDED}
    for _ in range(gangs):
        t0 = time.perf_counter()
        seq = await publish_submit(nc, spec)
        job_id = None
        t_placed = None
        while True:
            record = await anext(events)
            state.apply(record.seq, record.event)
            job_id = job_id or state.job_by_submit.get(seq)
            if not job_id:
                continue
            if t_placed is None and count(state, job_id, live) == HOSTS:
                t_placed = time.perf_counter() - t0
            if count(state, job_id, started_states) == HOSTS and t_placed is not None:
                placed.append(t_placed)
                running.append(time.perf_counter() - t0)
            if state.jobs[job_id].state in JOB_TERMINAL:
                break
    await events.aclose()
    await nc.close()
    return {
        "gang_hosts": HOSTS, "gangs": gangs,
        "placed_median_ms": round(statistics.median(placed) * 1000, 1),
        "placed_p90_ms": round(sorted(placed)[int(0.9 * (len(placed) - 1))] * 1000, 1),
        "placed_max_ms": round(max(placed) * 1000, 1),
        "running_median_ms": round(statistics.median(running) * 1000, 1),
    }


async def stress(stack: Stack, gangs: int) -> dict[str, object]:
    nc = await nats_io.connect(stack.nats.url, "berth-bench", stack.nats.admin_creds())
    state = ClusterState()
    events = nats_io.follow_events(nc.jetstream())
    t0 = time.perf_counter()
    seqs = [await publish_submit(nc, gang(f"stress{i}", SUB, "sub",
                                          ["python3", "-c", "import time; time.sleep(0.1)"]))
            for i in range(gangs)]
    done = 0
    while done < gangs:
        record = await anext(events)
        state.apply(record.seq, record.event)
        ids = [state.job_by_submit.get(s) for s in seqs]
        done = sum(1 for j in ids if j and state.jobs[j].state in JOB_TERMINAL)
    elapsed = time.perf_counter() - t0
    states = sorted({state.jobs[j].state.display for j in map(state.job_by_submit.get, seqs)
                     if j})
    await events.aclose()
    redis = redis_io.open_client(stack.redis.settings_for(redis_auth.DOCTOR))
    report = await check_cluster(nc.jetstream(), ReservationStore(redis))
    await redis.aclose()
    await nc.close()
    return {"gangs": gangs, "gang_size": SUB, "seconds": round(elapsed, 2),
            "gangs_per_s": round(gangs / elapsed, 1), "job_states": states,
            "double_booked_hosts": report.double_booked_hosts,
            "violations": len(report.violations()),
            "refused_double_bookings": report.refused_double_bookings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-gangs", type=int, default=20)
    parser.add_argument("--stress-gangs", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp), workers=0)
        try:
            for i in range(HOSTS):
                stack.start_worker(f"big-{i:02d}", 1, 512, "--tpu", "v5p:2x2x1:4",
                                   "-a", "tpu-name=big", "-a", f"tpu-worker-id={i}",
                                   "-a", f"sub=s{i // SUB}")
            nc_ready = asyncio.run(_wait_for_workers(stack, HOSTS))
            print(json.dumps({"workers_ready_s": nc_ready}))
            print(json.dumps({"latency": asyncio.run(latency(stack, args.latency_gangs))}))
            print(json.dumps({"stress": asyncio.run(stress(stack, args.stress_gangs))}))
        finally:
            stack.stop()


async def _wait_for_workers(stack: Stack, n: int) -> float:
    t0 = time.perf_counter()
    nc = await nats_io.connect(stack.nats.url, "berth-bench", stack.nats.admin_creds())
    state = ClusterState()
    events = nats_io.follow_events(nc.jetstream())
    while sum(1 for w in state.workers.values() if w.alive) < n:
        record = await anext(events)
        state.apply(record.seq, record.event)
    await events.aclose()
    await nc.close()
    return round(time.perf_counter() - t0, 2)


if __name__ == "__main__":
    main()
