"""Ray on W1's shape, for setting berth's W1 beside a peer on the same machine the same day.

N one-CPU no-op tasks are submitted at once to a local Ray started with C logical CPUs; the
rate is N over the time from the first `.remote()` to the last result. 2 logical CPUs is
Ray's best case here (two reused worker processes, no spread); 1,000 or 4,000 is W1's
cluster (1,000 hosts x 4 cpu), where Ray starts a worker process per running task.

Ray is not a dependency of berth, so this script is not run in CI; run it from a venv of
its own:

    python3 -m venv /tmp/rayenv && /tmp/rayenv/bin/pip install ray
    /tmp/rayenv/bin/python bench/peers/ray_tasks.py --cpus 2,1000 --tasks 20000

Prints one JSON line per run. `machine_cpu_s` is the whole machine's busy CPU time over the
timed window (/proc/stat), so every Ray process is counted, its workers included; run it
on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ray  # type: ignore[import-not-found]


def machine_busy_seconds() -> float:
    """CPU seconds every core has spent busy since boot (all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def one_run(cpus: int, tasks: int) -> dict[str, object]:
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level="ERROR")
    try:

        @ray.remote(num_cpus=1)
        def noop() -> int:
            return 0

        # Workers started and the function exported before the clock starts, as berth's
        # W1 starts its timer on a stack already up.
        ray.get([noop.remote() for _ in range(200)])
        busy0, t0 = machine_busy_seconds(), time.perf_counter()
        refs = [noop.remote() for _ in range(tasks)]
        submitted = time.perf_counter() - t0
        ray.get(refs)
        elapsed = time.perf_counter() - t0
        busy = machine_busy_seconds() - busy0
    finally:
        ray.shutdown()
    return {
        "peer": "ray",
        "version": ray.__version__,
        "logical_cpus": cpus,
        "tasks": tasks,
        "tasks_per_s": round(tasks / elapsed),
        "submit_s": round(submitted, 2),
        "total_s": round(elapsed, 2),
        "machine_cpu_s": round(busy, 2),
        "machine_cpu_ms_per_task": round(1000 * busy / tasks, 3),
        "machine_cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpus", default="2,1000", help="logical CPU counts, comma-separated")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=1, help="runs of each CPU count")
    args = parser.parse_args()
    for _ in range(args.runs):
        for cpus in (int(c) for c in args.cpus.split(",")):
            print(json.dumps(one_run(cpus, args.tasks)), flush=True)


if __name__ == "__main__":
    main()
