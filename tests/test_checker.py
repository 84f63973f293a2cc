"""The checker finds every kind of violation it names (fed a doctored Redis view)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from berth.services.scheduler.placement import Host, Unit, place
from berth.shared.capacity import Amounts
from berth.shared.checker import check
from berth.shared.lifecycle import ClusterState, Kill
from berth.shared.messages import (
    AnyEvent,
    AttemptReported,
    Coscheduling,
    DeviceHealthChanged,
    GpuDevice,
    GpuTelemetry,
    JobSpec,
    JobSubmitted,
    Resources,
    TaskAssigned,
    WorkerRegistered,
    parse_attempt_key,
)
from berth.shared.reservations import Allocation, GroupUsage, HostUsage
from berth.shared.states import TaskState

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


def test_a_release_the_leader_still_owes_is_not_a_violation() -> None:
    """Reservations of ended attempts: owed while the event that ended them is after the
    leader's RELEASED_THROUGH (a leader behind the log), a leak once it is not. One never
    assigned in the log (a commit not yet logged) is a disagreement either way, left to
    check_cluster's second read."""
    ended = AttemptReported(job_id="j1", task_index=0, attempt_id=0, worker_id="w1",
                            state=TaskState.SUCCEEDED, exit_code=0)
    state = fold(worker(), job("j1"), assign("j1"), ended)  # the end is event 4
    redis = [host({"j1/0/0": Allocation("j1", NEED, (30000,), ""),
                   "j9/0/0": Allocation("j9", NEED, (), "")})]
    report = check(state, redis, [], released_through=3, released_at={"j1/0/0": 4})
    assert report.releases_owed == ["w1: j1/0/0"] and report.released_through == 3
    assert report.reservations_without_attempt == ["w1: j9/0/0"]
    assert "w1: j1/0/0" not in " ".join(report.violations())
    report = check(state, redis, [], released_through=4, released_at={"j1/0/0": 4})
    assert report.releases_owed == []
    assert report.reservations_without_attempt == ["w1: j1/0/0", "w1: j9/0/0"]
    # Without the release sequences (the pure check as before), no release is owed.
    assert check(state, redis, []).reservations_without_attempt == ["w1: j1/0/0",
                                                                    "w1: j9/0/0"]


def test_a_commit_whose_assignment_is_not_logged_yet_is_not_a_violation() -> None:
    """A reservation of a pending task's next attempt is a commit the leader has yet to
    log; one of an attempt id the log has passed is not."""
    retried = job("j2")
    retried = replace(retried, spec=replace(retried.spec, max_retries_failure=1))
    state = fold(worker(), job("j1"), retried, assign("j2"),
                 AttemptReported(job_id="j2", task_index=0, attempt_id=0, worker_id="w1",
                                 state=TaskState.FAILED, exit_code=1))
    assert state.jobs["j2"].tasks[0].state == TaskState.PENDING  # retried
    redis = [host({f"{key}": Allocation(key[:2], NEED, (), "")
                   for key in ("j1/0/0", "j1/0/3", "j2/0/0", "j2/0/1", "j1/1/0", "garbage")})]
    report = check(state, redis, [], released_through=5)
    assert report.assignments_unlogged == ["w1: j1/0/0", "w1: j1/0/3", "w1: j2/0/1"]
    # j2/0/0 ended (at or before RELEASED_THROUGH): a leak; j1 has no task 1.
    assert report.reservations_without_attempt == ["w1: garbage", "w1: j1/1/0", "w1: j2/0/0"]
    assert report.releases_owed == []


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


GPU = Resources(cpu=1, memory_mb=100, device=GpuDevice(variant="h100", count=1))


def gpu_worker(worker_id: str = "g1", count: int = 2) -> WorkerRegistered:
    return WorkerRegistered(worker_id=worker_id, incarnation="i", resources=Resources(
        cpu=64, memory_mb=64000, device=GpuDevice(variant="h100", count=count)))


def gpu_job(job_id: str, replicas: int = 1) -> JobSubmitted:
    return JobSubmitted(job_id=job_id, submit_seq=int(job_id[1:]), spec=JobSpec(
        name="t", command=["x"], replicas=replicas, resources=GPU))


def test_a_device_given_twice_is_double_booked() -> None:
    state = fold(gpu_worker(), gpu_job("j1"), gpu_job("j2"),
                 TaskAssigned(job_id="j1", task_index=0, attempt_id=0, worker_id="g1",
                              incarnation="i", epoch=1, devices=[1]),
                 TaskAssigned(job_id="j2", task_index=0, attempt_id=0, worker_id="g1",
                              incarnation="i", epoch=1, devices=[1]))
    one = Amounts(1000, 100, 0, 1)
    redis = [HostUsage("g1", Amounts(64000, 64000, 0, 2), Amounts(2000, 200, 0, 2), "gpu:h100",
                       None, {"j1/0/0": Allocation("j1", one, (), "", devices=(1,)),
                              "j2/0/0": Allocation("j2", one, (), "", devices=(1,))})]
    report = check(state, redis, [])
    assert report.devices_given_twice == ["g1: device 1 to j1/0/0 and j2/0/0",
                                          "g1: device 1 to j1/0/0 and j2/0/0 (redis)"]
    assert report.double_booked_devices == 1 and not report.ok


def redis_view(state: ClusterState) -> list[HostUsage]:
    """What the Lua commits would hold for the fold's live attempts."""
    hosts = []
    for w in state.workers.values():
        allocs = {}
        for key, (job_id, index, attempt_id) in w.live_attempts.items():
            attempt = state.jobs[job_id].tasks[index].attempt(attempt_id)
            assert attempt is not None
            allocs[key] = Allocation(job_id, state.jobs[job_id].spec.resources.amounts, (), "",
                                     devices=tuple(attempt.devices))
        hosts.append(HostUsage(w.worker_id, w.resources.amounts, w.used, "gpu:h100", None,
                               allocs))
    return hosts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.lists(st.integers(0, 30), max_size=4)),
                min_size=1, max_size=8))
def test_placing_from_the_fold_never_double_books_a_device(
        rounds: list[tuple[int, list[int]]]) -> None:
    """The scheduler's loop without transport: each round places pending one-GPU tasks on
    the fold's free devices, folds the assignments, and lets some attempts exit; the
    checker never finds a device held twice, and every live GPU attempt holds one."""
    events: list[AnyEvent] = [gpu_worker("g1", 2), gpu_worker("g2", 3)]
    state = fold(*events)
    seq = len(events)
    for n, (new_jobs, exits) in enumerate(rounds):
        for k in range(new_jobs):
            seq += 1
            state.apply(seq, gpu_job(f"j{10 * n + k + 1}", replicas=2))
        hosts = [Host(w.worker_id, w.free, w.resources.device_kind,
                      free_devices=w.free_devices) for w in state.workers.values()]
        units = [Unit(job_id, (index,), GPU.amounts, GPU.device_kind)
                 for job_id, index in state.pending]
        for a in place(units, hosts).assignments:
            seq += 1
            state.apply(seq, TaskAssigned(
                job_id=a.job_id, task_index=a.task_index, attempt_id=0, worker_id=a.worker_id,
                incarnation="i", epoch=1, devices=list(a.devices)))
        report = check(state, redis_view(state), [])
        assert report.double_booked_devices == 0 and report.ok, report
        for worker in state.workers.values():  # one device per live attempt, freed on exit
            assert sorted(worker.devices_used.values()) == sorted(worker.live_attempts)
        live = [(w.worker_id, key) for w in state.workers.values() for key in w.live_attempts]
        for pick in exits:
            if live:
                worker_id, key = live.pop(pick % len(live))
                job_id, index, attempt_id = parse_attempt_key(key)
                seq += 1
                state.apply(seq, AttemptReported(job_id=job_id, task_index=index,
                                                 attempt_id=attempt_id, worker_id=worker_id,
                                                 state=TaskState.SUCCEEDED, exit_code=0))


def test_an_unhealthy_device_takes_no_new_attempts_until_it_is_returned() -> None:
    state = fold(gpu_worker("g1", 2), gpu_job("j1"),
                 DeviceHealthChanged(worker_id="g1", index=0, healthy=False,
                                     reason="3 uncorrectable ECC errors"))
    g1 = state.workers["g1"]
    assert g1.free_devices == [1] and g1.unhealthy == {0: "3 uncorrectable ECC errors"}
    host = Host("g1", g1.free, "gpu:h100", free_devices=g1.free_devices)
    both = place([Unit("j1", (0,), GPU.amounts, GPU.device_kind),
                  Unit("j2", (0,), GPU.amounts, GPU.device_kind)], [host])
    assert [a.devices for a in both.assignments] == [(1,)]
    assert "need 1, largest free 0" in both.pending_reasons[("j2", 0)]
    # A restarted agent does not heal the card; an operator's enable does.
    state.apply(10, WorkerRegistered(worker_id="g1", incarnation="i2",
                                     resources=gpu_worker().resources))
    assert state.workers["g1"].free_devices == [1]
    state.apply(11, DeviceHealthChanged(worker_id="g1", index=0, healthy=True))
    assert state.workers["g1"].free_devices == [0, 1]


def test_an_attempts_gpu_figures_land_on_it_with_its_exit() -> None:
    used = GpuTelemetry(peak_memory_mb=10610, mean_utilization=61.5, peak_utilization=99,
                        samples=12)
    state = fold(gpu_worker(), gpu_job("j1"),
                 TaskAssigned(job_id="j1", task_index=0, attempt_id=0, worker_id="g1",
                              incarnation="i", epoch=1, devices=[0]),
                 AttemptReported(job_id="j1", task_index=0, attempt_id=0, worker_id="g1",
                                 state=TaskState.SUCCEEDED, exit_code=0, gpu=used))
    attempt = state.jobs["j1"].tasks[0].attempts[0]
    assert attempt.gpu == used and state.workers["g1"].free_devices == [0, 1]


def test_attempts_on_a_device_that_turns_unhealthy_end_as_a_worker_failure() -> None:
    state = fold(gpu_worker("g1", 2), gpu_job("j1"),
                 TaskAssigned(job_id="j1", task_index=0, attempt_id=0, worker_id="g1",
                              incarnation="i", epoch=1, devices=[1]))
    effects = state.apply(10, DeviceHealthChanged(worker_id="g1", index=1, healthy=False,
                                                  reason="GPU is lost"))
    why = "device 1 of g1 is unhealthy: GPU is lost"
    assert effects == [Kill("g1", "i", "j1", 0, 0, why)]
    task = state.jobs["j1"].tasks[0]
    # Retried elsewhere under its preemption budget: not the user's failure.
    assert (task.state, task.preemption_count, task.failure_count) == (
        TaskState.PENDING, 1, 0)
    assert (task.attempts[0].worker_failure, task.attempts[0].error) == (True, why)
    # The device stays held until the process is confirmed gone, then out of service.
    assert state.workers["g1"].devices_used == {1: "j1/0/0"}
    state.apply(11, AttemptReported(job_id="j1", task_index=0, attempt_id=0, worker_id="g1",
                                    state=TaskState.KILLED, error=why))
    assert state.workers["g1"].devices_used == {} and state.workers["g1"].free_devices == [0]
    assert task.state == TaskState.PENDING
    # The device failed under the attempt: the host's fault, counted toward quarantine.
    assert len(state.workers["g1"].failures) == 1


def test_an_operators_device_disable_kills_but_does_not_count_toward_quarantine() -> None:
    state = fold(gpu_worker("g1", 2), gpu_job("j1"),
                 TaskAssigned(job_id="j1", task_index=0, attempt_id=0, worker_id="g1",
                              incarnation="i", epoch=1, devices=[1]))
    effects = state.apply(10, DeviceHealthChanged(worker_id="g1", index=1, healthy=False,
                                                  reason="swap", by="ops"))
    assert effects == [Kill("g1", "i", "j1", 0, 0, "device 1 of g1 is unhealthy: swap")]
    assert state.workers["g1"].failures == []
