"""The sweep (services/scheduler/sweep.py): the waiting tasks a walk stopped short never
reaches get their pending reasons and scheduling timeouts a slice at a time. Its
bookkeeping in a table; on a full cluster, its slices find what one walk of the whole queue
finds, on drawn queues; and real ticks (real nats-server and Redis) that time tasks out and
announce their reasons a slice each."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS

from berth.services.scheduler import placement, service, sweep
from berth.services.scheduler.service import Leader
from berth.shared import nats_io, servers, subjects
from berth.shared.capacity import Amounts
from berth.shared.messages import (
    AnyEvent,
    Constraint,
    Coscheduling,
    CpuDevice,
    GpuDevice,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    PendingReasonsChanged,
    Priority,
    Quota,
    QuotaSet,
    Resources,
    TaskAssigned,
    WorkerRegistered,
)
from berth.shared.states import TaskState
from tests.test_idle_tick import folder, new_leader, register
from tests.test_lifecycle import registered, submitted
from tests.test_reconcile import leader_on


@pytest.mark.parametrize(("jobs", "pending", "looked_at", "budget", "taken", "at"), [
    (["a", "b", "c"], {"a", "b", "c"}, set(), 2, ["a", "b"], 2),
    (["a", "b", "c"], {"a", "c"}, set(), 2, ["a", "c"], 3),  # b was placed or cancelled
    (["a", "b", "c"], {"a", "b", "c"}, {"a"}, 2, ["b", "c"], 3),  # the walk saw a
    (["big", "b"], {"big", "b"}, set(), 2, ["big"], 1),  # a job of 3 tasks: over, whole
    ([], set(), set(), 2, [], 0),
])
def test_take(jobs: list[str], pending: set[str], looked_at: set[str], budget: int,
              taken: list[str], at: int) -> None:
    s = sweep.Sweep(jobs)
    count = {"big": 3}.get
    assert s.take(dict.fromkeys(pending), looked_at, lambda j: count(j, 1), budget) == taken
    assert s.at == at
    assert s.done is (at == len(jobs))


def with_one_worker(cpu: int) -> tuple[Leader, Callable[[AnyEvent], None]]:
    """A leader whose fold has it elected and worker w0 (of `cpu` cpus) registered, and
    what folds more events into it."""
    leader = new_leader()
    fold = folder(leader.state)
    fold(LeaderElected(scheduler_id="s", epoch=1, ts=time.time()))
    fold(register("w0", "i0", cpu=cpu))
    return leader, fold


def job(n: int, cpu: int) -> JobSubmitted:
    """Job j<n>, of one task of `cpu` cpus, the n+1-th submitted."""
    return JobSubmitted(job_id=f"j{n}", submit_seq=n + 1, ts=time.time(), spec=JobSpec(
        name="t", command=["true"], resources=Resources(cpu=cpu, memory_mb=100)))


@pytest.mark.parametrize(("truncated", "exhausted", "sliced", "runs_on"), [
    (False, True, True, True),  # stopped short for want of room: the next slice
    (True, False, False, True),  # at its limit: the tasks behind are about to be placed
    (False, False, False, False),  # it looked at every unit: the sweep's work is done
])
def test_a_slice_follows_only_a_walk_stopped_short_for_want_of_room(
        truncated: bool, exhausted: bool, sliced: bool, runs_on: bool) -> None:
    leader, fold = with_one_worker(cpu=1)
    fold(job(0, cpu=2))
    leader._file_pending()
    leader.sweep = sweep.Sweep(["j0"])
    walked = placement.Placement(truncated=truncated, exhausted=exhausted)
    reasons = leader._sweep_after(walked)
    assert bool(reasons) is sliced
    assert (leader.sweep is not None) is (runs_on and not sliced)


def test_a_task_arriving_during_a_ticks_last_slice_is_not_skipped() -> None:
    """A slice files what entered the pending tasks since the walk, but the next tick must
    still see that it changed: a smaller task arriving then may fit where the walk found no
    room, and a skipped tick would leave it waiting."""
    leader, fold = with_one_worker(cpu=2)
    state = leader.state
    now = time.time()
    fold(job(0, 1))
    fold(TaskAssigned(job_id="j0", task_index=0, attempt_id=0, worker_id="w0",
                      incarnation="i0", epoch=1, ts=now))
    fold(job(1, 2))  # 1 cpu free: it waits
    leader._file_pending()
    hosts = leader._hosts()
    stop_below = leader._stop_below(now)
    assert stop_below is not None and leader.sweep is not None
    walked = placement.place(leader._units(), hosts, limits=(state.limits, state.usage),
                             stop_below=stop_below, index=leader.host_index)
    # j1's 2 cpu fit on no host: left out of the walk, which is then empty.
    assert leader.left_out == {Amounts(2000, 100)} and not walked.pending_reasons
    fold(job(2, 1))  # submitted while the tick awaited: it fits
    assert leader._sweep_after(walked) == {
        ("j1", 0): "insufficient cpu: need 2 cores, largest free 1 core on 1 worker"}
    assert leader.sweep is None  # that was its last slice
    leader._note_idle(hosts, walked, preempted=False)
    assert leader.idle is not None  # this tick placed nothing ...
    assert not leader._may_skip(leader._hosts())  # ... but the next is not skipped
    assert [a.job_id for a in placement.place(
        leader._units(), leader._hosts(), limits=(state.limits, state.usage)).assignments
    ] == ["j2"]


def test_a_job_that_fits_nowhere_is_told_so_at_the_next_tick() -> None:
    """A job arriving with a need no host has room for is left out of the walks, and the
    sweep looks at it in the next tick, not at its next start."""
    leader, fold = with_one_worker(cpu=2)
    state = leader.state
    now = time.time()

    def tick(at: float) -> dict[tuple[str, int], str]:
        leader._file_pending()
        hosts = leader._hosts()
        walked = placement.place(leader._units(), hosts, stop_below=leader._stop_below(at),
                                 limits=(state.limits, state.usage), index=leader.host_index)
        return {**walked.pending_reasons, **leader._sweep_after(walked)}

    fold(job(0, cpu=1))
    assert tick(now) == {} and leader.sweep is None  # j0 fits; the first sweep is over
    fold(job(1, cpu=64))
    assert tick(now + 1) == {  # the next sweep is 9 s away
        ("j1", 0): "insufficient cpu: need 64 cores, largest free 2 cores on 1 worker"}
    assert leader.left_out == {Amounts(64000, 100)} and leader.sweep is None


# --- on a full cluster, a sweep's slices find what a walk of the whole queue does ------------

waiting_jobs = st.lists(st.tuples(
    st.sampled_from(["one", "two", "huge", "nowhere", "gang", "quota"]),
    st.integers(1, 3)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(waiting_jobs, st.integers(1, 7))
def test_a_sweeps_slices_find_the_reasons_of_a_whole_walk(
        jobs: list[tuple[str, int]], budget: int) -> None:
    leader = new_leader()
    state = leader.state
    fold = folder(state)
    now = time.time()
    fold(LeaderElected(scheduler_id="s", epoch=1, ts=now))
    fold(QuotaSet(user="capped", quota=Quota(cpu=500), ts=now))
    for w in range(3):  # every cpu taken: a walk stops at once
        fold(register(f"w{w}", "i0", cpu=2))
        for i in range(2):
            fold(JobSubmitted(job_id=f"r{w}-{i}", submit_seq=1, ts=now, spec=JobSpec(
                name="r", command=["true"], priority=Priority.PRODUCTION,
                resources=Resources(cpu=1, memory_mb=100))))
            fold(TaskAssigned(job_id=f"r{w}-{i}", task_index=0, attempt_id=0,
                              worker_id=f"w{w}", incarnation="i0", epoch=1, ts=now))
    for n, (kind, replicas) in enumerate(jobs):
        # A band below the running one's: none of them may evict.
        spec = JobSpec(name="t", command=["true"], replicas=replicas, priority=Priority.BATCH,
                       user="capped" if kind == "quota" else "u",
                       resources=Resources(cpu={"two": 2, "huge": 64}.get(kind, 1),
                                           memory_mb=100),
                       constraints=[Constraint(key="zone", op="IN", values=["mars"])]
                       if kind == "nowhere" else [],
                       coscheduling=Coscheduling(group_by="rack") if kind == "gang" else None)
        fold(JobSubmitted(job_id=f"j{n}", submit_seq=n + 10, ts=now, spec=spec))
    leader._file_pending()
    hosts = leader._hosts()
    limits = (state.limits, state.usage)
    whole = placement.place(leader._units(), hosts, limits=limits)
    assert not whole.assignments

    stop_below = leader._stop_below(now)
    assert stop_below is not None and leader.sweep is not None
    walked = placement.place(leader._units(), hosts, limits=limits, stop_below=stop_below,
                             index=leader.host_index)
    # No host has a cpu free: every need is left out of the walk, or it stops at once.
    assert not walked.assignments and (walked.exhausted or leader.left_out)
    found = dict(walked.pending_reasons)
    while leader.sweep is not None:
        reasons = leader._sweep_slice(walked, budget)
        assert len(reasons) < budget + 3  # over its budget by less than a job of 3
        assert not set(reasons) & set(found)  # no task looked at twice
        found.update(reasons)
    assert found == whole.pending_reasons


clusters = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4), st.booleans()),
                    min_size=1, max_size=5)  # per host: cpu, tasks running there, a GPU
queued = st.lists(st.tuples(st.integers(1, 3), st.booleans(), st.sampled_from(["u", "v"])),
                  min_size=1, max_size=25)  # per waiting job: cpu, a GPU, user


@settings(max_examples=100, deadline=None)
@given(clusters, queued)
def test_jobs_left_out_of_a_walk_fit_nowhere(
        cluster: list[tuple[int, int, bool]], queue: list[tuple[int, bool, str]]) -> None:
    """The jobs of a need no host has room for are left out of a tick's walk: a walk of
    the whole queue places none of them either, and for one user (whose order their
    charges do not change) it places exactly what the walk does."""
    leader = new_leader()
    state = leader.state
    fold = folder(state)
    now = time.time()
    fold(LeaderElected(scheduler_id="s", epoch=1, ts=now))
    gpu = GpuDevice(variant="h100")
    n = 0
    for w, (cpu, running, has_gpu) in enumerate(cluster):
        fold(WorkerRegistered(worker_id=f"w{w}", incarnation="i0", address="127.0.0.1",
                              resources=Resources(cpu=cpu, memory_mb=4096,
                                                  device=gpu if has_gpu else CpuDevice()),
                              ts=now))
        for _ in range(min(running, cpu)):
            fold(JobSubmitted(job_id=f"r{n}", submit_seq=1, ts=now, spec=JobSpec(
                name="r", command=["true"], priority=Priority.PRODUCTION,
                resources=Resources(cpu=1, memory_mb=100))))
            fold(TaskAssigned(job_id=f"r{n}", task_index=0, attempt_id=0, worker_id=f"w{w}",
                              incarnation="i0", epoch=1, ts=now))
            n += 1
    for j, (cpu, wants_gpu, user) in enumerate(queue):
        fold(JobSubmitted(job_id=f"j{j}", submit_seq=j + 10, ts=now, spec=JobSpec(
            name="t", command=["true"], user=user, priority=Priority.BATCH,
            resources=Resources(cpu=cpu, memory_mb=100,
                                device=gpu if wants_gpu else CpuDevice()))))
    leader._file_pending()
    hosts = leader._hosts()
    limits = (state.limits, state.usage)
    whole = placement.place(leader._units(), hosts, limits=limits)
    stop_below = leader._stop_below(now)
    walked = placement.place(leader._units(), hosts, limits=limits, stop_below=stop_below,
                             index=leader.host_index)
    left_out = {job_id for job_id, job in state.jobs.items()
                if job_id.startswith("j") and job.spec.resources.amounts in leader.left_out}
    assert not left_out & {a.job_id for a in whole.assignments}
    assert not left_out & {job_id for job_id, _ in walked.pending_reasons}
    if len({user for _, _, user in queue}) == 1:
        assert walked.assignments == whole.assignments


def test_reasons_beyond_one_announcements_share_wait_for_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`Leader._announce`: at most ANNOUNCED_AT_ONCE reasons per announcement, the rest
    kept (`unannounced`) with the next announcement's time noted; none kept while the
    interval holds an announcement back unless a sweep found it."""
    monkeypatch.setattr(service, "ANNOUNCED_AT_ONCE", 3)
    leader = new_leader()
    given: list[dict[tuple[str, int], str]] = []
    held_back = False

    async def announce(reasons: dict[tuple[str, int], str]) -> bool:
        if held_back:
            return False
        given.append(dict(reasons))
        return True

    monkeypatch.setattr(leader, "_announce_pending_reasons", announce)
    walked = {(f"w{n}", 0): "room" for n in range(4)}
    swept = {(f"s{n}", 0): "room" for n in range(2)}
    asyncio.run(leader._announce(walked, {}))
    assert given == [{("w0", 0): "room", ("w1", 0): "room", ("w2", 0): "room"}]
    assert leader.unannounced == {("w3", 0): "room"}
    assert leader.reasons_due > time.time()
    asyncio.run(leader._announce({}, swept))
    assert given[-1] == {("w3", 0): "room", ("s0", 0): "room", ("s1", 0): "room"}
    assert leader.unannounced == {}

    held_back = True
    asyncio.run(leader._announce(walked, {}))  # the next tick's walk finds them again
    assert leader.unannounced == {}
    asyncio.run(leader._announce({("w0", 0): "newer"}, swept))
    assert leader.unannounced == {**swept, ("w0", 0): "newer"}  # a slice is looked at once
    held_back = False
    asyncio.run(leader._announce({("w0", 0): "newest"}, {}))
    assert given[-1] == {**swept, ("w0", 0): "newest"} and leader.unannounced == {}


# --- real ticks --------------------------------------------------------------------------


async def test_ticks_time_out_the_tasks_past_the_walk_a_slice_each(
        nc: NATS, clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker of 4 cpu, full; 12 one-task jobs wait behind it with a scheduling timeout
    already run out, 12 more without one. A walk stops at the first of them; the sweep
    gives up 4 tasks a tick, and announces every waiting task's reason."""
    monkeypatch.setattr(sweep, "SWEEP_TASKS", 4)
    async with leader_on(nc, clean_servers[1]) as (leader, _, _):
        leader.settings = dataclasses.replace(leader.settings, pending_reason_interval=0.0)
        events = [registered(), submitted("j1", replicas=4)]
        events += [submitted(f"j{n}", scheduling_timeout=0.5 if n % 2 else None)
                   for n in range(2, 26)]
        for seq, event in enumerate(events, start=1):
            leader.state.apply(seq, event)
        leader._register_host(leader.state.workers["w1"])
        await asyncio.sleep(0.6)
        jobs = leader.state.jobs

        def given_up() -> set[str]:
            return {j for j, job in jobs.items()
                    if job.tasks[0].state == TaskState.UNSCHEDULABLE}

        assert await leader.tick() == 4  # j1 placed; the walk stops at j2
        assert leader.sweep is not None
        assert given_up() == {"j3", "j5"}  # the slice: j2 to j5
        ticks = 1
        while leader.sweep is not None:
            await leader.tick()
            ticks += 1
        assert ticks == 6  # 24 waiting, 4 a slice
        assert given_up() == {f"j{n}" for n in range(3, 26, 2)}

        js = nc.jetstream()
        follower = nats_io.follow_raw_events(js, 1, filter_subject=subjects.PENDING_REASONS)
        announced: dict[tuple[str, int], str] = {}
        try:
            while len(announced) < 12:
                raw = await asyncio.wait_for(anext(follower), 10)
                change = msgspec.json.decode(raw.data, type=PendingReasonsChanged)
                announced.update({(r.job_id, r.task_index): r.reason for r in change.reasons})
        finally:
            await follower.aclose()
        assert set(announced) == {(f"j{n}", 0) for n in range(2, 26, 2)}
        assert all(r.startswith("insufficient cpu") for r in announced.values())
