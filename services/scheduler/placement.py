"""Choosing hosts for pending tasks: a pure function over plain data, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskRequest:
    job_id: str
    task_index: int
    cpu_milli: int
    memory_mb: int


@dataclass
class HostCapacity:
    worker_id: str
    cpu_free_milli: int
    memory_free_mb: int


@dataclass
class Placement:
    assignments: list[tuple[TaskRequest, str]] = field(default_factory=list)
    pending_reasons: dict[tuple[str, int], str] = field(default_factory=dict)


def _cores(milli: int) -> str:
    return f"{milli / 1000:g} core" + ("" if milli == 1000 else "s")


def pending_reason(task: TaskRequest, hosts: Sequence[HostCapacity]) -> str:
    if not hosts:
        return "no live workers"
    best_cpu = max(h.cpu_free_milli for h in hosts)
    best_mem = max(h.memory_free_mb for h in hosts)
    n = len(hosts)
    if task.cpu_milli > best_cpu:
        return (f"insufficient cpu: need {_cores(task.cpu_milli)}, largest free "
                f"{_cores(best_cpu)} on {n} workers")
    if task.memory_mb > best_mem:
        return (f"insufficient memory: need {task.memory_mb} MiB, largest free "
                f"{best_mem} MiB on {n} workers")
    return f"no single worker has {_cores(task.cpu_milli)} and {task.memory_mb} MiB free together"


def place(tasks: Sequence[TaskRequest], hosts: Sequence[HostCapacity]) -> Placement:
    """Places tasks in the given (priority) order, each on the host with the most free cpu
    that fits it (spreading replicas), ties broken by worker id. Capacity used by an earlier
    task of the same call is taken into account, so one call never over-commits a host."""
    free = {h.worker_id: HostCapacity(h.worker_id, h.cpu_free_milli, h.memory_free_mb)
            for h in hosts}
    out = Placement()
    for task in tasks:
        best: HostCapacity | None = None
        for host in free.values():
            if host.cpu_free_milli < task.cpu_milli or host.memory_free_mb < task.memory_mb:
                continue
            if best is None or (host.cpu_free_milli, best.worker_id) > (
                best.cpu_free_milli, host.worker_id
            ):
                best = host
        if best is None:
            out.pending_reasons[(task.job_id, task.task_index)] = pending_reason(
                task, list(free.values())
            )
            continue
        best.cpu_free_milli -= task.cpu_milli
        best.memory_free_mb -= task.memory_mb
        out.assignments.append((task, best.worker_id))
    return out
