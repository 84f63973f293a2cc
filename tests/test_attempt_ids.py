"""No attempt key is used for two assignments across a scheduler take-over: the fold burns
a deposed leader's void late assignment, the leader skips ids Redis holds that the fold does
not know, and the checker counts a key assigned twice (docs/reliability.md, "Late
assignments")."""

from __future__ import annotations

import pytest

from berth.services.scheduler import attempt_ids
from berth.shared.checker import check
from berth.shared.messages import AnyEvent, LeaderElected, TaskAssigned
from berth.shared.reservations import Allocation
from berth.shared.state_snapshot import dump, load
from berth.shared.states import TaskState
from tests.test_checker import NEED, host
from tests.test_lifecycle import fold, registered, report, submitted

JOB = "j1-abcd"  # as berth makes them: the snapshot checks the spec
ELECTED = LeaderElected(scheduler_id="b", epoch=2)


def assign(attempt: int, worker: str, epoch: int, ts: float = 1.0) -> TaskAssigned:
    return TaskAssigned(job_id=JOB, task_index=0, attempt_id=attempt, worker_id=worker,
                        incarnation="i1", epoch=epoch, ts=ts)


BASE: list[AnyEvent] = [registered("w1"), registered("w2"), submitted(JOB)]


@pytest.mark.parametrize(("events", "next_id", "reused"), [
    # The deposed leader's late assignment 0 is void; 0 is burned, so the next is 1.
    ([ELECTED, assign(0, "w1", 1)], 1, []),
    # ... and the new leader's 1 folds as an ordinary assignment.
    ([ELECTED, assign(0, "w1", 1), assign(1, "w2", 2, ts=2)], 2, []),
    # The bug: the new leader reused the burned 0 (the worker that saw it never runs it).
    ([ELECTED, assign(0, "w1", 1), assign(0, "w2", 2, ts=2)], 1,
     [f"{JOB}/0/0: to w2 after a void assignment burned the id"]),
    # The other order: the new leader's 0 is folded first, then the deposed leader's 0.
    ([ELECTED, assign(0, "w2", 2, ts=2), assign(0, "w1", 1)], 1,
     [f"{JOB}/0/0: to w2 and to w1"]),
    # The same assignment folded twice (a leader applies its own, then reads it back).
    ([assign(0, "w1", 1), assign(0, "w1", 1)], 1, []),
    # A burned id above attempts that ended: still skipped.
    ([assign(0, "w1", 1), report(0, TaskState.FAILED, 1, job=JOB), ELECTED,
      assign(3, "w1", 1)], 4, []),
])
def test_the_fold_burns_a_void_late_assignments_id(
        events: list[AnyEvent], next_id: int, reused: list[str]) -> None:
    state, _ = fold([*BASE, *events])
    task = state.jobs[JOB].tasks[0]
    assert task.next_attempt_id() == next_id
    assert state.attempt_keys_reused == reused
    assert [f"attempt_keys_reused: {x}" for x in reused] == [
        v for v in check(state, [], []).violations() if v.startswith("attempt_keys_reused")]
    # A snapshot keeps both (a new leader loading it chooses the same ids).
    restored = load(dump(state, "s"), "s", state.last_seq)
    assert restored.jobs[JOB].tasks[0].next_attempt_id() == next_id
    assert restored.attempt_keys_reused == reused


def test_the_leader_skips_ids_redis_holds_that_the_fold_does_not_know() -> None:
    # The deposed leader reserved 0 on w1 in Redis; its TaskAssigned is not folded yet.
    state, _ = fold([*BASE, ELECTED])
    task = state.jobs[JOB].tasks[0]
    taken: attempt_ids.TakenIds = {}
    attempt_ids.note_reserved(state, [f"{JOB}/0/0", "gone-job/0/7"], taken)
    assert attempt_ids.next_id(task, taken) == 1
    # Kept once Redis lets it go (the reconcile releases it as stale): still burned.
    attempt_ids.note_reserved(state, [], taken)
    assert attempt_ids.next_id(task, taken) == 1
    # The fold's own attempts are not recorded: the map holds only what it would reuse.
    state.apply(0, assign(1, "w2", 2))
    attempt_ids.note_reserved(state, [f"{JOB}/0/1"], taken)
    assert attempt_ids.next_id(task, taken) == 2 and taken == {(JOB, 0): 0}


def test_the_checker_counts_a_key_reserved_on_two_hosts_in_redis() -> None:
    state, _ = fold(BASE)
    alloc = {f"{JOB}/0/0": Allocation(JOB, NEED, (), "")}
    report_ = check(state, [host(alloc, worker_id="w1"), host(alloc, worker_id="w2")], [])
    assert f"attempt_keys_reused: {JOB}/0/0: to w1 and to w2 (redis)" in report_.violations()
