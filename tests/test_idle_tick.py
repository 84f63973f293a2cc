"""Ticks skipped while nothing changed since one that placed nothing
(services/scheduler/idle_tick.py): a skipped tick must be one that would have placed
nothing. Table tests of the rule, then the leader's own check against a placement computed
afresh after every event of drawn sequences (submits, assignments, exits with retries and
backoffs, cordons, restarts, new workers, quotas), and the cases that must end a skip. Then
when a tick's walk of the queue may stop short (`Leader._stop_below`; placement's side is
in tests/test_placement.py)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.scheduler import idle_tick, placement
from berth.services.scheduler.service import MAX_TICK_PLACEMENTS, Leader
from berth.services.scheduler.sweep import SWEEP_EVERY
from berth.shared.capacity import Amounts
from berth.shared.config import Settings
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AnyEvent,
    AttemptReported,
    Backoff,
    Coscheduling,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    NodeAction,
    NodeHealthChanged,
    Priority,
    Quota,
    QuotaSet,
    Resources,
    RetryEvent,
    RetryPolicy,
    TaskAssigned,
    WorkerRegistered,
)
from berth.shared.states import TaskState
from tests.test_host_cache import _Bus, _Lease


def host(name: str, cpu: int = 1000) -> placement.Host:
    return placement.Host(name, Amounts(cpu, 1024, 0, 0), None, {}, "127.0.0.1", None,
                          set(), None, "", None)


A, B = host("a"), host("b")
IDLE = idle_tick.IdleTick([A, B], limits_seq=3, until=100.0)


@pytest.mark.parametrize(("idle", "hosts", "seq", "changed", "now", "skip"), [
    (IDLE, [A, B], 3, False, 50.0, True),
    (None, [A, B], 3, False, 50.0, False),  # no tick placed nothing yet
    (IDLE, [A, host("b")], 3, False, 50.0, False),  # b rebuilt: its capacity changed
    (IDLE, [A], 3, False, 50.0, False),  # b died
    (IDLE, [B, A], 3, False, 50.0, False),
    (IDLE, [A, B, host("c")], 3, False, 50.0, False),  # c joined
    (IDLE, [A, B], 4, False, 50.0, False),  # a quota or token limit changed
    (IDLE, [A, B], 3, True, 50.0, False),  # a task entered or left the pending set
    (IDLE, [A, B], 3, False, 100.0, False),  # a backoff or timeout came due
])
def test_may_skip(idle: idle_tick.IdleTick | None, hosts: list[placement.Host], seq: int,
                  changed: bool, now: float, skip: bool) -> None:
    assert idle_tick.may_skip(idle, hosts, seq, changed, now) is skip


def test_first_after() -> None:
    assert idle_tick.first_after([5.0, 12.0, 9.0], 6.0) == 9.0
    assert idle_tick.first_after([5.0], 5.0) == idle_tick.NEVER
    assert idle_tick.first_after([], 0.0) == idle_tick.NEVER


# --- the leader's check, against a placement computed afresh --------------------------------

WORKERS = ["w0", "w1"]
SHAPES = [(1, None), (2, None), (3, None)]  # cpu of each job shape
BACKOFF = 0.02
RETRY = RetryPolicy(on_events=[RetryEvent.ERROR], backoff=Backoff(initial=BACKOFF, max=BACKOFF))
# A backoff that outlasts the ticks a test makes before it waits it out, on a loaded machine
# too (BACKOFF ran out between two ticks when the suite ran in two processes on 2 cores).
LONG_BACKOFF = 0.5
LONG_RETRY = RetryPolicy(on_events=[RetryEvent.ERROR],
                         backoff=Backoff(initial=LONG_BACKOFF, max=LONG_BACKOFF))


def new_leader() -> Leader:
    return Leader(Settings.from_env(), _Bus(), None, "s", _Lease())  # type: ignore[arg-type]


def folder(state: ClusterState) -> Callable[[AnyEvent], None]:
    """Folds events into `state` in sequence, as the leader's follower would."""
    seq = itertools.count(1)
    return lambda event: state.apply(next(seq), event)


def register(worker: str, incarnation: str, cpu: int = 2) -> WorkerRegistered:
    return WorkerRegistered(worker_id=worker, incarnation=incarnation, address="127.0.0.1",
                            resources=Resources(cpu=cpu, memory_mb=4096), ts=time.time())


def submit(n: int, cpu: int, timeout: float | None = None,
           retry: RetryPolicy = RETRY) -> JobSubmitted:
    return JobSubmitted(job_id=f"j{n}", submit_seq=n + 1, ts=time.time(), spec=JobSpec(
        name="t", user=f"u{n % 2}", command=["true"], resources=Resources(cpu=cpu, memory_mb=100),
        retry=retry, max_retries_failure=3, scheduling_timeout=timeout))


def fresh_placement(leader: Leader, hosts: list[placement.Host]) -> placement.Placement:
    state = leader.state
    return placement.place(leader._units(), hosts, limit=MAX_TICK_PLACEMENTS,
                           limits=(state.limits, state.usage))


def one_tick(leader: Leader) -> tuple[bool, placement.Placement]:
    """What the leader's tick decides, without its commit: whether it would skip, and the
    placement a tick would compute (recorded as idle when it places nothing)."""
    hosts = leader._hosts()
    skip = leader._may_skip(hosts)
    leader.tick_limits_seq = leader.state.limits.seq
    result = fresh_placement(leader, hosts)
    if not skip:
        leader.idle = None
        # Nothing here is overdue (the tests' timeouts are long): no event to publish.
        asyncio.run(leader._give_up_overdue(result.pending_reasons))
        leader._note_idle(hosts, result, preempted=False)
    return skip, result


steps = st.lists(st.tuples(
    st.sampled_from(["submit", "succeed", "fail", "cordon", "uncordon", "restart", "join",
                     "quota", "wait"]),
    st.integers(0, 30), st.integers(0, 2)), max_size=40)


@settings(max_examples=100, deadline=None)
@given(steps)
def test_a_skipped_tick_would_have_placed_nothing(plan: list[tuple[str, int, int]]) -> None:
    """A leader ticking after every event, its placements committed at once: whenever it
    would skip, a placement computed afresh places nothing."""
    leader = new_leader()
    state: ClusterState = leader.state
    seq = 0
    counts = {"skipped": 0, "placed": 0}

    def apply(event: AnyEvent) -> None:
        nonlocal seq
        seq += 1
        state.apply(seq, event)

    def tick() -> None:
        skip, result = one_tick(leader)
        if skip:
            counts["skipped"] += 1
            assert not result.assignments, "a skipped tick would have placed"
            assert not result.truncated
            return
        for a in result.assignments:
            counts["placed"] += 1
            worker = state.workers[a.worker_id]
            target = state.jobs[a.job_id].tasks[a.task_index]
            apply(TaskAssigned(job_id=a.job_id, task_index=a.task_index,
                               attempt_id=len(target.attempts), worker_id=a.worker_id,
                               incarnation=worker.incarnation, epoch=1, ts=time.time()))

    def fold(event: AnyEvent) -> None:
        apply(event)
        tick()

    fold(LeaderElected(scheduler_id="s", epoch=1, ts=time.time()))
    workers = list(WORKERS)
    for w in workers:
        fold(register(w, "i0"))
    submitted = 0
    for action, n, k in plan:
        running = [(t, a) for job in state.jobs.values() for t in job.tasks
                   if (a := t.current_attempt) is not None and not a.exited]
        if action == "submit":
            fold(submit(submitted, SHAPES[k][0]))
            submitted += 1
        elif action in ("succeed", "fail") and running:
            task, attempt = running[n % len(running)]
            fold(AttemptReported(
                job_id=task.job_id, task_index=task.index, attempt_id=attempt.attempt_id,
                worker_id=attempt.worker_id,
                state=TaskState.SUCCEEDED if action == "succeed" else TaskState.FAILED,
                exit_code=0 if action == "succeed" else 1, ts=time.time()))
        elif action in ("cordon", "uncordon"):
            fold(NodeHealthChanged(worker_id=workers[k % len(workers)],
                                   action=NodeAction(action), by="admin", ts=time.time()))
        elif action == "restart":
            fold(register(workers[k % len(workers)], f"i{seq}"))
        elif action == "join" and len(workers) < 4:
            workers.append(f"w{len(workers)}")
            fold(register(workers[-1], "i0", cpu=k + 1))
        elif action == "quota":
            fold(QuotaSet(user="u0", quota=Quota(cpu=1000 * (k + 1)), ts=time.time()))
        elif action == "wait":
            time.sleep(BACKOFF + 0.005)  # a retry's backoff runs out
            tick()


def test_what_ends_a_skip() -> None:
    """A full cluster with work waiting: skipped until a host frees, new work comes, a
    limit changes, a backoff ends or a scheduling timeout comes due."""
    leader = new_leader()
    state = leader.state
    fold = folder(state)

    fold(LeaderElected(scheduler_id="s", epoch=1, ts=time.time()))
    fold(register("w0", "i0", cpu=1))
    fold(submit(0, 1, retry=LONG_RETRY))
    fold(TaskAssigned(job_id="j0", task_index=0, attempt_id=0, worker_id="w0",
                      incarnation="i0", epoch=1, ts=time.time()))
    fold(submit(1, 1))
    skip, result = one_tick(leader)
    assert not skip and not result.assignments and result.pending_reasons  # noted idle
    assert one_tick(leader)[0] is True

    fold(submit(2, 2))  # new work, of another shape
    assert one_tick(leader)[0] is False
    assert one_tick(leader)[0] is True

    fold(QuotaSet(user="someone", quota=Quota(cpu=500), ts=time.time()))
    assert one_tick(leader)[0] is False
    assert one_tick(leader)[0] is True

    fold(NodeHealthChanged(worker_id="w0", action=NodeAction.CORDON, by="admin",
                           ts=time.time()))
    assert one_tick(leader)[0] is False

    # j0 fails: its retry waits out a backoff; j1 is placed meanwhile.
    fold(NodeHealthChanged(worker_id="w0", action=NodeAction.UNCORDON, by="admin",
                           ts=time.time()))
    fold(AttemptReported(job_id="j0", task_index=0, attempt_id=0, worker_id="w0",
                         state=TaskState.FAILED, exit_code=1, ts=time.time()))
    skip, result = one_tick(leader)
    assert not skip and [a.job_id for a in result.assignments] == ["j1"]
    fold(TaskAssigned(job_id="j1", task_index=0, attempt_id=0, worker_id="w0",
                      incarnation="i0", epoch=1, ts=time.time()))
    assert one_tick(leader)[0] is False
    assert one_tick(leader)[0] is True
    assert leader.idle is not None and leader.idle.until == state.backoff[("j0", 0)]
    time.sleep(max(0.0, state.backoff[("j0", 0)] - time.time()) + 0.01)
    assert one_tick(leader)[0] is False  # the backoff ended: looked at again

    # A scheduling timeout: skipped until the first waiting one runs out.
    fold(submit(3, 2, timeout=60.0))
    assert one_tick(leader)[0] is False
    assert one_tick(leader)[0] is True
    assert leader.idle is not None
    assert leader.idle.until == pytest.approx(state.jobs["j3"].tasks[0].pending_since + 60)


def test_a_walk_stops_short_only_where_no_waiting_task_could_preempt() -> None:
    """`Leader._stop_below`: the least need of the waiting tasks, except while a waiting
    task might evict a running one (a band above the lowest running, or a gang of that
    band). A sweep of the waiting tasks starts once per SWEEP_EVERY, never two at once."""
    leader = new_leader()
    state = leader.state
    fold = folder(state)

    def job(n: int, priority: Priority, cpu: int = 1, gang: bool = False) -> JobSubmitted:
        return JobSubmitted(job_id=f"j{n}", submit_seq=n + 1, ts=time.time(), spec=JobSpec(
            name="t", command=["true"], priority=priority, replicas=2 if gang else 1,
            resources=Resources(cpu=cpu, memory_mb=100),
            coscheduling=Coscheduling(group_by="rack") if gang else None))

    fold(LeaderElected(scheduler_id="s", epoch=1, ts=time.time()))
    fold(register("w0", "i0", cpu=1))
    fold(job(0, Priority.INTERACTIVE))
    fold(TaskAssigned(job_id="j0", task_index=0, attempt_id=0, worker_id="w0",
                      incarnation="i0", epoch=1, ts=time.time()))
    fold(job(1, Priority.INTERACTIVE, cpu=2))
    fold(job(2, Priority.BATCH))
    leader._file_pending()
    now = time.time()
    assert leader._stop_below(now) == Amounts(1000, 100)  # the least of 2 cpu and 1 cpu
    first = leader.sweep  # the first tick starts a sweep
    assert first is not None and first.jobs == ["j1", "j2"]
    assert leader.sweep_due == now + SWEEP_EVERY
    assert leader._stop_below(now + SWEEP_EVERY) == Amounts(1000, 100)
    assert leader.sweep is first  # one still running is not restarted
    leader.sweep = None
    leader._stop_below(now + SWEEP_EVERY)
    assert leader.sweep is not None and leader.sweep is not first

    fold(job(3, Priority.INTERACTIVE, gang=True))  # a gang of the running band may evict
    leader._file_pending()
    assert leader._stop_below(now) is None
    fold(job(4, Priority.PRODUCTION))  # a band above the running one may evict
    leader._file_pending()
    assert leader._stop_below(now) is None
    assert leader.sweep is None  # a walk of the whole queue sees every waiting task
