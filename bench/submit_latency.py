"""Submit → SUCCEEDED latency of a 1-task job on the embedded stack (`berth up`).

Starts a fresh stack in a temporary directory, submits N one-task jobs one after another
(`true`, 0.1 cpu), and times each from the JetStream publish until the job's state, folded
from the events stream exactly as the scheduler and dashboard fold it, is SUCCEEDED. Also
prints the median of each stage, from the timestamps the job's events carry.

    .venv/bin/python bench/submit_latency.py [--jobs 20] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from sigterm import tear_down_on_sigterm  # bench/sigterm.py, beside this script

from berth.client import publish_submit
from berth.shared import nats_io, servers
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import JobSpec, Resources, encode
from berth.shared.states import JobState
from berth.stack import start_stack

# The stages of one job, from the timestamps its events carry (one machine, one clock):
# the client's publish, the submitter's job_submitted, the scheduler's assignment, the
# worker's RUNNING and exit, and the client's fold seeing SUCCEEDED.
STAGES = ("publish_to_submitted", "submitted_to_assigned", "assigned_to_running",
          "running_to_exited", "exited_to_seen")


async def measure(server: servers.ServerProcess, jobs: int
                  ) -> tuple[list[float], dict[str, list[float]]]:
    nc = await nats_io.connect(server.url, "berth-bench", server.admin_creds())
    js = nc.jetstream()
    state = ClusterState()
    events = nats_io.follow_events(js)
    latencies: list[float] = []
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    spec = encode(JobSpec(name="lat", command=["true"], resources=Resources(cpu=0.1,
                                                                            memory_mb=16)))
    for _ in range(jobs):
        started = time.perf_counter()
        published = time.time()
        seq = await publish_submit(nc, spec)
        job_id = None
        while True:
            record = await anext(events)
            state.apply(record.seq, record.event)
            job_id = job_id or state.job_by_submit.get(seq)
            if job_id and state.jobs[job_id].state == JobState.SUCCEEDED:
                latencies.append(time.perf_counter() - started)
                seen = time.time()
                job = state.jobs[job_id]
                attempt = job.tasks[0].attempts[-1]
                marks = [published, job.submitted_at, attempt.assigned_at,
                         attempt.started_at or 0.0, attempt.finished_at or 0.0, seen]
                for name, a, b in zip(STAGES, marks, marks[1:], strict=False):
                    stages[name].append(b - a)
                break
    await events.aclose()
    await nc.close()
    return latencies, stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    tear_down_on_sigterm()
    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp), workers=args.workers)
        try:
            time.sleep(2)  # let workers register
            lat, stages = asyncio.run(measure(stack.nats, args.jobs))
        finally:
            stack.stop()
    ms = sorted(x * 1000 for x in lat)
    print(json.dumps({
        "benchmark": "submit_to_succeeded_1_task", "jobs": len(ms),
        "median_ms": round(statistics.median(ms), 1), "min_ms": round(ms[0], 1),
        "max_ms": round(ms[-1], 1),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1),
        "stage_median_ms": {name: round(1000 * statistics.median(values), 2)
                            for name, values in stages.items()},
    }))


if __name__ == "__main__":
    main()
