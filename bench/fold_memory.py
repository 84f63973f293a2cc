"""Memory the fold keeps per finished job, and where it goes (issue 18's W4 memory row).

Folds, in process, a history shaped like W4's: workers register, then N one-task jobs are
submitted, assigned in ticks of 200 (`tasks_assigned`), and reported RUNNING then
SUCCEEDED in coalesced batches (`attempts_reported`). Every event goes through the same
decode as a real reader (`read_event` from its JSON bytes). Prints the bytes the fold
holds per job (tracemalloc), the objects it holds per job by type and how many of them the
cyclic garbage collector tracks (a full collection walks each: at 200,000 jobs its pauses
cost the scheduler its lease), the time of one full collection, and the CPU per event of
decoding and folding (measured in a fold of its own, without tracemalloc).

    .venv/bin/python bench/fold_memory.py [--jobs 50000] [--workers 1000]
    .venv/bin/python bench/fold_memory.py --quick
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
import tracemalloc

import msgspec

from berth.services.scheduler.pending_queue import PendingQueue, place_of
from berth.shared import subjects
from berth.shared.event_origin import read_event
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AttemptReported,
    AttemptsReported,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    Resources,
    TaskAssigned,
    TasksAssigned,
    WorkerRegistered,
    encode,
)
from berth.shared.states import TaskState

TICK = 200


def history(jobs: int, workers: int) -> list[tuple[str, bytes]]:
    """(subject, event JSON) in stream order."""
    now = time.time()
    out: list[tuple[str, bytes]] = [(subjects.LEADER_EVENTS, encode(
        LeaderElected(scheduler_id="bench", epoch=1, ts=now)))]
    for w in range(workers):
        out.append((subjects.worker_events(f"w{w}"), encode(WorkerRegistered(
            worker_id=f"w{w}", incarnation="i1", host=f"host{w}",
            address=f"10.0.{w // 250}.{w % 250}",
            resources=Resources(cpu=4, memory_mb=4096), ts=now))))
    for start in range(0, jobs, TICK):
        ids = []
        for j in range(start, min(jobs, start + TICK)):
            seq = j + 1
            job_id = f"j{seq}-{seq % 65536:04x}"
            ids.append(job_id)
            spec = JobSpec(name=f"t{j}", user="bench", command=["sim"],
                           resources=Resources(cpu=1, memory_mb=100))
            out.append((subjects.submit_outcome("bench", seq), encode(JobSubmitted(
                job_id=job_id, submit_seq=seq, spec=spec, ts=now))))
        where = {job_id: f"w{(start + k) % workers}" for k, job_id in enumerate(ids)}
        out.append((subjects.ASSIGNMENTS, encode(TasksAssigned(epoch=1, assignments=[
            TaskAssigned(job_id=job_id, task_index=0, attempt_id=0, worker_id=w,
                         incarnation="i1", epoch=1, ts=now) for job_id, w in where.items()]))))
        for state in (TaskState.RUNNING, TaskState.SUCCEEDED):
            by_worker: dict[str, list[AttemptReported]] = collections.defaultdict(list)
            for job_id, w in where.items():
                by_worker[w].append(AttemptReported(
                    job_id=job_id, task_index=0, attempt_id=0, worker_id=w, state=state,
                    exit_code=0 if state == TaskState.SUCCEEDED else None, ts=now))
            for w, reports in by_worker.items():
                out.append((subjects.attempt_reports(w), encode(
                    AttemptsReported(worker_id=w, reports=reports))))
    return out


def objects_by_type(roots: list[object]) -> tuple[collections.Counter[str], int]:
    """Objects reachable from `roots` (the fold's own), counted by type name, and how many
    of them the cyclic garbage collector tracks (each one a full collection walks)."""
    seen: set[int] = set()
    counts: collections.Counter[str] = collections.Counter()
    tracked = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        counts[type(obj).__name__] += 1
        tracked += gc.is_tracked(obj)
        if isinstance(obj, msgspec.Struct):  # gc=False ones show the collector no fields
            stack.extend(getattr(obj, name) for name in obj.__struct_fields__)
        else:
            stack.extend(gc.get_referents(obj))
    return counts, tracked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=1_000)
    parser.add_argument("--quick", action="store_true", help="2,000 jobs (CI)")
    args = parser.parse_args()
    jobs = 2_000 if args.quick else args.jobs
    events = history(jobs, args.workers)

    # The workers and the empty fold are not per job: folded before the jobs.
    split = 1 + args.workers

    def workers_folded() -> ClusterState:
        state = ClusterState()
        for seq, (subject, data) in enumerate(events[:split], start=1):
            state.apply(seq, read_event(subject, data))
        return state

    # CPU first, in a fold of its own: tracemalloc slows every allocation.
    state = workers_folded()
    cpu = time.process_time()
    for seq, (subject, data) in enumerate(events[split:], start=split + 1):
        state.apply(seq, read_event(subject, data))
    cpu = time.process_time() - cpu
    del state
    state = workers_folded()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for seq, (subject, data) in enumerate(events[split:], start=split + 1):
        state.apply(seq, read_event(subject, data))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()

    # At W4's peak every job of the burst waits at once: what the fold and the scheduler's
    # pending queue keep per waiting job (the unit templates are built only for the jobs a
    # tick reaches, so they are not in it).
    waiting_state = workers_folded()
    queue = PendingQueue()
    submits = [(subject, data) for subject, data in events[split:]
               if subjects.is_submit_outcome(subject)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for seq, (subject, data) in enumerate(submits, start=split + 1):
        waiting_state.apply(seq, read_event(subject, data))
    queue.sync(waiting_state.pending, lambda job_id: place_of(waiting_state.jobs[job_id]))
    gc.collect()
    waiting_held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    waiting = len(queue.indices)

    finished = sum(1 for job in state.jobs.values() if job.finished_at is not None)
    counts, tracked = objects_by_type([state.jobs, state.job_by_submit, state.pending,
                                       state.recent_use])
    full_collection = time.perf_counter()
    gc.collect()
    full_collection = time.perf_counter() - full_collection
    per_job = {name: round(n / jobs, 2) for name, n in counts.most_common(14)}
    result = {
        "jobs": jobs, "finished": finished, "events": len(events) - split,
        "fold_bytes_per_job": round(held / jobs),
        "waiting": waiting,
        "bytes_per_waiting_job": round(waiting_held / max(1, waiting)),
        "us_per_event_decode_and_fold": round(1e6 * cpu / (len(events) - split), 1),
        "gc_tracked_per_job": round(tracked / jobs, 2),
        "full_gc_collection_ms": round(1000 * full_collection, 1),
        "objects_per_job": per_job,
    }
    json.dump(result, sys.stdout)
    print()
    print(f"{jobs} finished one-task jobs: {held / jobs:,.0f} bytes each in the fold "
          f"(tracemalloc); {result['us_per_event_decode_and_fold']} us of CPU per event, "
          "decode and fold")
    print(f"{waiting} waiting one-task jobs: {waiting_held / max(1, waiting):,.0f} bytes each in "
          "the fold and the scheduler's pending queue")


if __name__ == "__main__":
    main()
