from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.placement import HostCapacity, TaskRequest, place


def test_spreads_replicas_and_respects_capacity() -> None:
    tasks = [TaskRequest("j", i, 1000, 100) for i in range(3)]
    hosts = [HostCapacity("a", 2000, 1000), HostCapacity("b", 2000, 1000)]
    result = place(tasks, hosts)
    assert [w for _, w in result.assignments] == ["a", "b", "a"]
    assert result.pending_reasons == {}


def test_pending_reason_names_the_shortfall() -> None:
    hosts = [HostCapacity("a", 2000, 4096), HostCapacity("b", 1000, 2048)]
    result = place([TaskRequest("j", 0, 1000, 16384)], hosts)
    assert result.assignments == []
    assert result.pending_reasons[("j", 0)] == (
        "insufficient memory: need 16384 MiB, largest free 4096 MiB on 2 workers")
    result = place([TaskRequest("j", 0, 4000, 10)], hosts)
    assert result.pending_reasons[("j", 0)] == (
        "insufficient cpu: need 4 cores, largest free 2 cores on 2 workers")
    assert place([TaskRequest("j", 0, 1, 1)], []).pending_reasons[("j", 0)] == "no live workers"


@given(
    st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 4096)), max_size=40),
    st.lists(st.tuples(st.integers(0, 8000), st.integers(0, 8192)), max_size=8),
)
def test_never_over_commits_a_host(tasks: list[tuple[int, int]],
                                   hosts: list[tuple[int, int]]) -> None:
    requests = [TaskRequest("j", i, c, m) for i, (c, m) in enumerate(tasks)]
    caps = [HostCapacity(f"h{i}", c, m) for i, (c, m) in enumerate(hosts)]
    result = place(requests, caps)
    used: dict[str, list[int]] = {}
    for task, worker in result.assignments:
        u = used.setdefault(worker, [0, 0])
        u[0] += task.cpu_milli
        u[1] += task.memory_mb
    for cap in caps:
        u = used.get(cap.worker_id, [0, 0])
        assert u[0] <= cap.cpu_free_milli and u[1] <= cap.memory_free_mb
    placed = {(t.job_id, t.task_index) for t, _ in result.assignments}
    assert placed.isdisjoint(result.pending_reasons)
    assert len(placed) + len(result.pending_reasons) == len(requests)
