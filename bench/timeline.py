"""What the host timeline costs on a large cluster (docs/performance.md, "Host timeline"):
a real fold of HOSTS workers each of which ran ATTEMPTS attempts (a tenth of them still
running), then the dashboard's timeline code on it: one page of hosts as the API answers
it (JSON included), the cluster sample the projection takes after each folded batch, and
the index a snapshot load rebuilds.

    python bench/timeline.py            # 10,000 hosts, 10 attempts each
    python bench/timeline.py --quick    # 200 hosts: checks it runs, in CI
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import msgspec

from berth.services.dashboard_api import timeline
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AttemptReported,
    JobSpec,
    JobSubmitted,
    Resources,
    TaskAssigned,
    WorkerRegistered,
)
from berth.shared.states import TaskState


def fold_history(hosts: int, attempts: int) -> ClusterState:
    """Round r ran every host's r-th attempt, as jobs of 100 tasks (one per host); the last
    round still runs on a tenth of the hosts."""
    state = ClusterState()
    seq = 0

    def apply(event: object) -> None:
        nonlocal seq
        seq += 1
        state.apply(seq, event)  # type: ignore[arg-type]

    for h in range(hosts):
        apply(WorkerRegistered(worker_id=f"w{h:05d}", incarnation="i", ts=1.0,
                               resources=Resources(cpu=8, memory_mb=16_000)))
    submits = 0
    for r in range(attempts):
        for first in range(0, hosts, 100):
            submits += 1
            job_id = f"j{submits}-0000"
            width = min(100, hosts - first)
            apply(JobSubmitted(job_id=job_id, submit_seq=submits, ts=10.0 * r, spec=JobSpec(
                name="b", command=["x"], replicas=width,
                resources=Resources(cpu=1, memory_mb=10))))
            for i in range(width):
                h, ts = first + i, 10.0 * r + 1
                apply(TaskAssigned(job_id=job_id, task_index=i, attempt_id=0,
                                   worker_id=f"w{h:05d}", incarnation="i", epoch=1, ts=ts))
                apply(AttemptReported(job_id=job_id, task_index=i, attempt_id=0,
                                      worker_id=f"w{h:05d}", state=TaskState.RUNNING,
                                      ts=ts + 1))
                if r < attempts - 1 or h % 10:
                    apply(AttemptReported(job_id=job_id, task_index=i, attempt_id=0,
                                          worker_id=f"w{h:05d}", state=TaskState.SUCCEEDED,
                                          exit_code=0, ts=ts + 5))
    return state


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """The median of `repeat` runs, in milliseconds of this process's CPU time (a shared
    machine's wall clock measures the neighbours too), and the last result."""
    times: list[float] = []
    result: object = None
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        times.append((time.process_time() - start) * 1000)
    return statistics.median(times), result


QUICK = {"hosts": 120, "attempts": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=10_000)
    parser.add_argument("--attempts", type=int, default=10, help="per host")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['hosts']} hosts, {QUICK['attempts']} attempts")
    args = parser.parse_args()
    if args.quick:
        args.hosts, args.attempts = QUICK["hosts"], QUICK["attempts"]
    print(json.dumps(measure(args.hosts, args.attempts)))


def measure(hosts: int, attempts: int) -> dict[str, object]:
    """Folds the history, measures (CPU time), and checks every answer it timed."""
    start = time.process_time()
    state = fold_history(hosts, attempts)
    fold_s = time.process_time() - start
    index_ms, index = timed(lambda: timeline.build_index(state), 1)
    assert isinstance(index, dict)
    until = 10.0 * attempts + 100
    out: dict[str, object] = {"hosts": hosts, "attempts_per_host": attempts,
                              "fold_s": round(fold_s, 2), "build_index_ms": round(index_ms, 1)}
    for limit in (100, timeline.MAX_HOSTS):
        def page(limit: int = limit) -> bytes:
            rows, total, cursor = timeline.host_page(state, index, 0, until, None, limit, None)
            return msgspec.json.encode(timeline.Timeline(
                since=0, until=until, hosts=rows, total_hosts=total, next_cursor=cursor,
                truncated=False, cluster=[]))
        ms, body = timed(page, 5)
        assert isinstance(body, bytes)
        answer = json.loads(body)
        assert len(answer["hosts"]) == min(limit, hosts)
        assert all(len(r["bars"]) == attempts and not r["overlaps"]
                   for r in answer["hosts"])
        out[f"page_{limit}_hosts_ms"] = round(ms, 1)
        out[f"page_{limit}_hosts_bytes"] = len(body)
    sample_ms, point = timed(lambda: timeline.cluster_point(state, until), 5)
    assert isinstance(point, timeline.ClusterPoint)
    assert point.running == point.hosts_busy == (hosts + 9) // 10, point
    out["cluster_sample_ms"] = round(sample_ms, 2)
    return out


if __name__ == "__main__":
    main()
