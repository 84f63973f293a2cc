"""The leader's hosts, kept between ticks (`Leader._hosts`, its HostIndex), always equal
hosts built afresh from the fold: a stale one would let placement offer capacity, ports or
devices another attempt holds, or a host out of service. And the index's ranking, holds and
free total always equal those made afresh from its hosts. Drawn sequences of assignments,
exits, node health verdicts, device health changes, deaths, re-registrations and
preemptors' holds, checked after every event."""

from __future__ import annotations

import time
from dataclasses import astuple

from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.scheduler import placement
from berth.services.scheduler.host_index import HostIndex, rank
from berth.services.scheduler.placement import takes_any_work
from berth.services.scheduler.service import Leader
from berth.shared.capacity import Amounts
from berth.shared.config import Settings
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AnyEvent,
    AttemptReported,
    DeviceHealthChanged,
    GpuDevice,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    NodeAction,
    NodeHealthChanged,
    PreemptionReleased,
    Resources,
    TaskAssigned,
    TasksPreempted,
    WorkerDeclaredDead,
    WorkerRegistered,
)
from berth.shared.states import TaskState

WORKERS = ["w0", "w1", "w2"]
GPU = GpuDevice(variant="h100", count=2)


class _Bus:
    def jetstream(self, **_: object) -> None:
        return None


class _Lease:
    epoch = 1
    sent = time.monotonic()


def fresh(state: ClusterState) -> dict[str, placement.Host]:
    """Every live worker's host, normalised as placement works on it: free devices lowest
    first, and counted no higher than listed."""
    hosts = {}
    for w in state.workers.values():
        if w.alive:
            host = placement.Host(w.worker_id, w.free, w.resources.device_kind, w.attributes,
                                  w.address, w.holder, set(w.ports_used), w.free_devices,
                                  w.out_of_service, w.held_for)
            host.free = placement.free_amounts(host)
            hosts[w.worker_id] = host
    return hosts


def check_index(index: HostIndex) -> None:
    hosts = index.listed()
    assert index.ranked == sorted(rank(h) for h in hosts if takes_any_work(h))
    # Which hosts, not their order (placement takes a preemptor's own host by rank).
    assert {job: sorted(h.worker_id for h in held)
            for job, held in index.held_by_job().items()} == {
        job: sorted(h.worker_id for h in hosts if h.held_for == job)
        for job in {h.held_for for h in hosts} if job is not None}
    assert index.total == sum((h.free for h in hosts), Amounts())
    assert index.most_free() == Amounts(*(max((getattr(h.free, d) for h in hosts), default=0)
                                          for d in ("cpu", "mem", "disk", "dev")))


def register(worker: str, incarnation: str) -> WorkerRegistered:
    return WorkerRegistered(worker_id=worker, incarnation=incarnation, address="127.0.0.1",
                            resources=Resources(cpu=4, memory_mb=4096, device=GPU), ts=1.0)


steps = st.lists(st.tuples(st.sampled_from(["assign", "exit", "cordon", "uncordon",
                                            "sick", "healed", "restart", "die", "hold",
                                            "unhold"]),
                           st.integers(0, 2), st.integers(0, 7)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(steps)
def test_kept_hosts_equal_fresh_ones(plan: list[tuple[str, int, int]]) -> None:
    leader = Leader(Settings.from_env(), _Bus(), None, "s", _Lease())  # type: ignore[arg-type]
    state = leader.state
    seq = 0

    def fold(event: AnyEvent) -> None:
        nonlocal seq
        seq += 1
        state.apply(seq, event)
        kept = {h.worker_id: astuple(h) for h in leader._hosts()}
        assert kept == {w: astuple(h) for w, h in fresh(state).items()}
        check_index(leader.host_index)

    fold(LeaderElected(scheduler_id="s", epoch=1, ts=1.0))
    for w in WORKERS:
        fold(register(w, "i0"))
    for j in range(8):
        fold(JobSubmitted(job_id=f"j{j}", submit_seq=j + 1, ts=1.0, spec=JobSpec(
            name="t", command=["true"], ports=["http"],
            resources=Resources(cpu=1, memory_mb=100, device=GpuDevice(variant="h100",
                                                                       count=1)))))
    restarts = 0
    for action, w, j in plan:
        worker = state.workers[WORKERS[w]]
        job = state.jobs[f"j{j}"]
        task = job.tasks[0]
        if action == "assign" and task.state == TaskState.PENDING:
            hosts = placement.place([placement.Unit(f"j{j}", (0,), job.spec.resources.amounts,
                                                    job.spec.resources.device_kind,
                                                    ports=("http",))],
                                    [h for h in leader._hosts() if h.worker_id == worker.worker_id])
            for a in hosts.assignments:
                fold(TaskAssigned(job_id=a.job_id, task_index=0, attempt_id=len(task.attempts),
                                  worker_id=a.worker_id, incarnation=worker.incarnation,
                                  epoch=1, ts=2.0, ports=a.ports, devices=list(a.devices)))
        elif action == "exit" and (attempt := task.current_attempt) is not None and \
                not attempt.exited:
            fold(AttemptReported(job_id=f"j{j}", task_index=0, attempt_id=attempt.attempt_id,
                                 worker_id=attempt.worker_id, state=TaskState.FAILED,
                                 exit_code=1, ts=3.0))
        elif action in ("cordon", "uncordon"):
            fold(NodeHealthChanged(worker_id=worker.worker_id, action=NodeAction(action),
                                   by="admin", ts=4.0))
        elif action in ("sick", "healed"):
            fold(DeviceHealthChanged(worker_id=worker.worker_id, index=j % 2,
                                     healthy=action == "healed", ts=5.0))
        elif action == "restart":
            restarts += 1
            fold(register(worker.worker_id, f"i{restarts}"))
        elif action == "die":
            fold(WorkerDeclaredDead(worker_id=worker.worker_id, incarnation=worker.incarnation,
                                    epoch=1, ts=6.0))
        elif action == "hold":
            fold(TasksPreempted(id=f"p{seq}", job_id=f"j{j}", victims=[],
                                hosts=[worker.worker_id], epoch=1, ts=7.0))
        elif action == "unhold":
            fold(PreemptionReleased(id=f"r{seq}", job_id=f"j{j}", hosts=[worker.worker_id],
                                    epoch=1, ts=8.0))


host_changes = st.lists(st.dictionaries(
    st.integers(0, 39),
    st.none() | st.tuples(st.integers(0, 4000), st.sampled_from([None, "p1", "p2"]),
                          st.booleans(), st.sampled_from([None, [1, 0], [0]])),
    max_size=12), max_size=25)


@settings(max_examples=150, deadline=None)
@given(host_changes)
def test_an_index_updated_one_host_at_a_time_or_all_at_once_is_the_same(
        rounds: list[dict[int, tuple[int, str | None, bool, list[int] | None] | None]]
        ) -> None:
    """A few changed hosts are put one at a time, many make the index again at once: the
    hosts, ranking, holds and total are the same either way, round after round."""
    index = HostIndex()
    expected: dict[str, placement.Host] = {}
    for changes in rounds:
        changed: dict[str, placement.Host | None] = {}
        for n, made in changes.items():
            worker_id = f"w{n:02d}"
            if made is None:
                changed[worker_id] = None
                expected.pop(worker_id, None)
                continue
            cpu, held_for, away, devices = made
            changed[worker_id] = placement.Host(
                worker_id, Amounts(cpu, 100, 0, 2), held_for=held_for,
                out_of_service="cordoned" if away else "",
                free_devices=None if devices is None else list(devices))
            host = placement.Host(worker_id, Amounts(cpu, 100, 0, 2), held_for=held_for,
                                  out_of_service="cordoned" if away else "",
                                  free_devices=None if devices is None else sorted(devices))
            host.free = placement.free_amounts(host)
            expected[worker_id] = host
        index.update(changed)
        assert {h.worker_id: astuple(h) for h in index.listed()} == {
            w: astuple(h) for w, h in expected.items()}
        check_index(index)
