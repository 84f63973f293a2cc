"""The checker finds every kind of violation it names (fed a doctored Redis view)."""

from __future__ import annotations

from shared.capacity import Amounts
from shared.checker import check
from shared.lifecycle import ClusterState
from shared.messages import (
    AnyEvent,
    Coscheduling,
    JobSpec,
    JobSubmitted,
    Resources,
    TaskAssigned,
    WorkerRegistered,
)
from shared.reservations import Allocation, GroupUsage, HostUsage

CAP = Amounts(4000, 1000, 0, 0)
NEED = Amounts(1000, 100, 0, 0)


def fold(*events: AnyEvent) -> ClusterState:
    state = ClusterState()
    for seq, event in enumerate(events, start=1):
        state.apply(seq, event)
    return state


def job(job_id: str, gang: bool = False) -> JobSubmitted:
    return JobSubmitted(job_id=job_id, submit_seq=int(job_id[1:]), spec=JobSpec(
        name="t", command=["x"], resources=Resources(cpu=1, memory_mb=100), ports=["p"],
        coscheduling=Coscheduling(group_by="rack") if gang else None))


def assign(job_id: str, worker: str = "w1", port: int = 30000, group: str = "") -> TaskAssigned:
    return TaskAssigned(job_id=job_id, task_index=0, attempt_id=0, worker_id=worker,
                        incarnation="i", epoch=1, ports={"p": port}, group=group)


def worker(worker_id: str = "w1") -> WorkerRegistered:
    return WorkerRegistered(worker_id=worker_id, incarnation="i", attributes={"rack": "r"},
                            resources=Resources(cpu=4, memory_mb=1000))


def host(allocs: dict[str, Allocation], used: Amounts | None = None,
         worker_id: str = "w1") -> HostUsage:
    total = sum((a.need for a in allocs.values()), Amounts())
    return HostUsage(worker_id, CAP, used if used is not None else total, "", None, allocs)


def test_a_consistent_cluster_has_no_violations() -> None:
    state = fold(worker(), job("j1"), assign("j1"))
    report = check(state, [host({"j1/0/0": Allocation("j1", NEED, (30000,), "")})], [])
    assert report.ok and report.double_booked_hosts == 0


def test_every_violation_is_found() -> None:
    state = fold(worker(), job("j1", gang=True), job("j2", gang=True), job("j3"),
                 assign("j1", group="rack=r"), assign("j2", group="rack=r", port=30001),
                 assign("j3", port=30001))
    over = Amounts(5000, 100, 0, 0)
    report = check(state, [host({"j9/0/0": Allocation("j9", over, (), "")})],
                   [GroupUsage("rack=r", "j1", ("w1",), True, 1)])
    assert report.over_committed == ["w1: redis ['cpu'] used beyond capacity"]
    assert report.hosts_shared_by_gangs == ["w1: j1, j2"]
    assert report.groups_held_twice == ["rack=r: j1, j2"]
    assert report.ports_given_twice == ["w1: port 30001 to j2/0/0 and j3/0/0"]
    assert report.reservations_without_attempt == ["w1: j9/0/0"]
    assert report.attempts_without_reservation == ["w1: j1/0/0", "w1: j2/0/0", "w1: j3/0/0"]
    assert report.double_booked_hosts == 1 and not report.ok


def test_a_port_given_twice_on_one_address_is_double_booked() -> None:
    """Two workers on one address: one port to two live attempts is a violation, in the
    log and in Redis, even though each worker alone holds the port once."""
    on_a = [WorkerRegistered(worker_id=w, incarnation="i", address="127.0.0.1",
                             resources=Resources(cpu=4, memory_mb=1000)) for w in ("w1", "w2")]
    state = fold(*on_a, job("j1"), job("j2"), assign("j1", "w1"), assign("j2", "w2"))
    redis = [host({"j1/0/0": Allocation("j1", NEED, (30000,), "", "127.0.0.1")}, None, "w1"),
             host({"j2/0/0": Allocation("j2", NEED, (30000,), "", "127.0.0.1")}, None, "w2")]
    report = check(state, redis, [])
    assert report.ports_given_twice == [
        "127.0.0.1: port 30000 to j1/0/0 and j2/0/0",
        "127.0.0.1: port 30000 to j1/0/0 and j2/0/0 (redis)"]
    assert report.double_booked_ports == 1 and not report.ok
    # On two addresses the same port is fine.
    state = fold(worker("w1"), worker("w2"), job("j1"), job("j2"), assign("j1", "w1"),
                 assign("j2", "w2"))
    redis = [host({"j1/0/0": Allocation("j1", NEED, (30000,), "", "w1")}, None, "w1"),
             host({"j2/0/0": Allocation("j2", NEED, (30000,), "", "w2")}, None, "w2")]
    assert check(state, redis, []).double_booked_ports == 0
