"""How long one tick's synchronous parts hold the scheduler's event loop with a long queue:
in process, on a leader's fold of 10,000 hosts and 150,000 waiting one-task jobs, no I/O.
Every part measured here runs without yielding, and the lease is renewed from the same
loop (every TTL/3, valid for 0.8 TTL: 2.4 s with the defaults). docs/performance.md, "No
tick that holds the loop for seconds".

- full: every host's cpu taken (W4 mid-burst). A tick's walk (every need left out: no
  host has a cpu free), `_preempt`'s look for a preemptor, each slice of the sweep, and,
  for comparison, the walk of the whole queue that one tick in ten seconds made before
  the sweep.
- gpu_backlog: the hosts have cpu free, every GPU is busy, and the waiting jobs want GPUs,
  with 10 cpu jobs behind them. A tick's walk leaves the GPU jobs out (no host has a GPU
  free) and places the cpu jobs; the sweep gives the GPU jobs their reasons. For
  comparison, the walk of the whole queue, which every tick of such a cluster made
  before (the walk could not stop short: the cpu jobs might fit).

    .venv/bin/python bench/tick_hold.py [--hosts 10000] [--waiting 150000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from berth.services.scheduler import fencing, placement
from berth.services.scheduler.service import MAX_TICK_PLACEMENTS, Leader
from berth.shared.config import Settings
from berth.shared.messages import (
    AnyEvent,
    GpuDevice,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    Resources,
    TaskAssigned,
    WorkerRegistered,
)

CPU_TASK = Resources(cpu=1, memory_mb=100)
GPU_TASK = Resources(cpu=1, memory_mb=100, device=GpuDevice(variant="h100"))
GPU_HOSTS = 0.01  # of the hosts, in the GPU backlog


class _NoBus:
    """What a leader is given for its bus: nothing measured here publishes."""

    def jetstream(self, **_: object) -> None:
        return None


class _Fold:
    def __init__(self) -> None:
        self.leader = Leader(Settings.from_env(), _NoBus(), None, "bench",  # type: ignore[arg-type]
                             fencing.Lease(epoch=1, after_seq=0, sent=time.monotonic()))
        self.seq = 0
        self.jobs = 0
        self.now = time.time()
        self.apply(LeaderElected(scheduler_id="bench", epoch=1, ts=self.now))

    def apply(self, event: AnyEvent) -> None:
        self.seq += 1
        self.leader.state.apply(self.seq, event)

    def host(self, n: int, resources: Resources) -> str:
        worker = f"w{n:05d}"
        self.apply(WorkerRegistered(worker_id=worker, incarnation="i0", address="127.0.0.1",
                                    resources=resources, ts=self.now))
        return worker

    def job(self, resources: Resources, on: str | None = None) -> None:
        job_id = f"j{self.jobs}"
        self.jobs += 1
        self.apply(JobSubmitted(job_id=job_id, submit_seq=self.jobs, ts=self.now, spec=JobSpec(
            name="t", command=["true"], resources=resources)))
        if on is not None:
            self.apply(TaskAssigned(job_id=job_id, task_index=0, attempt_id=0, worker_id=on,
                                    incarnation="i0", epoch=1, ts=self.now))

    def walk(self, whole: bool = False) -> tuple[float, placement.Placement]:
        """A tick's placement, timed: as a tick makes it (`_stop_below`), or of the whole
        queue, nothing stopping it short or left out (what a tick made before)."""
        leader, state = self.leader, self.leader.state
        leader._file_pending()
        hosts = leader._hosts()
        below = None
        if whole:
            leader.left_out = frozenset()
        else:
            below = leader._stop_below(time.time())
        started = time.perf_counter()
        result = placement.place(leader._units(), hosts, limit=MAX_TICK_PLACEMENTS,
                                 limits=(state.limits, state.usage), stop_below=below,
                                 index=leader.host_index)
        return time.perf_counter() - started, result


def _sweep(fold: _Fold, walked: placement.Placement) -> dict[str, object]:
    """Every slice of the sweep the walk started, timed."""
    leader = fold.leader
    slices: list[float] = []
    reasons = 0
    while leader.sweep is not None:
        started = time.perf_counter()
        reasons += len(leader._sweep_slice(walked))
        slices.append(time.perf_counter() - started)
    return {"sweep_slices": len(slices), "sweep_slice_max_s": round(max(slices, default=0), 4),
            "sweep_total_s": round(sum(slices), 3), "sweep_reasons": reasons}


def full(hosts: int, waiting: int) -> dict[str, object]:
    fold = _Fold()
    for n in range(hosts):
        worker = fold.host(n, Resources(cpu=4, memory_mb=4096))
        for _ in range(4):
            fold.job(CPU_TASK, on=worker)
    for _ in range(waiting):
        fold.job(CPU_TASK)
    leader = fold.leader
    walk_s, walked = fold.walk()
    stopped_short = walked.exhausted or bool(leader.left_out)
    started = time.perf_counter()
    asyncio.run(leader._preempt(walked))
    preempt_s = time.perf_counter() - started
    swept = _sweep(fold, walked)
    whole_s, whole = fold.walk(whole=True)
    return {
        "scenario": "full", "hosts": hosts, "waiting": waiting,
        "walk_s": round(walk_s, 4), "walk_placed": len(walked.assignments),
        "walk_stopped_short": stopped_short,
        "preempt_look_s": round(preempt_s, 4), **swept,
        "whole_walk_s": round(whole_s, 3), "whole_walk_reasons": len(whole.pending_reasons),
    }


def gpu_backlog(hosts: int, waiting: int) -> dict[str, object]:
    fold = _Fold()
    gpus = max(1, round(hosts * GPU_HOSTS))
    for n in range(hosts):
        if n < gpus:
            worker = fold.host(n, Resources(cpu=4, memory_mb=4096, device=GpuDevice(
                variant="h100")))
            fold.job(GPU_TASK, on=worker)  # its one GPU busy
        else:
            worker = fold.host(n, Resources(cpu=4, memory_mb=4096))
            fold.job(Resources(cpu=2, memory_mb=100), on=worker)  # half its cpu busy
    for _ in range(waiting):
        fold.job(GPU_TASK)
    for _ in range(10):
        fold.job(CPU_TASK)
    walk_s, walked = fold.walk()
    left_out = len(fold.leader.left_out)
    swept = _sweep(fold, walked)
    whole_s, whole = fold.walk(whole=True)
    return {
        "scenario": "gpu_backlog", "hosts": hosts, "waiting": waiting + 10,
        "walk_s": round(walk_s, 4), "walk_placed": len(walked.assignments),
        "walk_reasons": len(walked.pending_reasons), "needs_left_out": left_out, **swept,
        "whole_walk_s": round(whole_s, 3), "whole_walk_reasons": len(whole.pending_reasons),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=10_000)
    parser.add_argument("--waiting", type=int, default=150_000)
    parser.add_argument("--quick", action="store_true", help="500 hosts, 5,000 waiting (CI)")
    args = parser.parse_args()
    hosts, waiting = (500, 5_000) if args.quick else (args.hosts, args.waiting)
    for scenario in (full, gpu_backlog):
        result = scenario(hosts, waiting)
        print(json.dumps(result), flush=True)
        held = {k: v for k, v in result.items() if k.endswith("_s")}
        print(f"{result['scenario']:12} {hosts} hosts, {result['waiting']} waiting: "
              + ", ".join(f"{k} {v}" for k, v in held.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
