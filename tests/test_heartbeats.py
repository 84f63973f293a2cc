"""The leader's reading of a heartbeat: what to kill, and what to send again."""

from __future__ import annotations

from berth.services.scheduler.heartbeats import judge
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import Heartbeat
from berth.shared.states import TaskState
from tests.test_lifecycle import assigned, cancel, fold, registered, report, submitted

S = TaskState
GRACE = 2.0


def state_with(*attempts: int) -> ClusterState:
    """Job j1 with one task per attempt id given, each assigned to w1 at ts=100."""
    events: list = [registered(), submitted(replicas=len(attempts))]
    for index, attempt in enumerate(attempts):
        event = assigned(attempt, index=index)
        event.ts = 100.0
        events.append(event)
    state, _ = fold(events)
    return state


def heartbeat(*attempts: str, reported_seq: int = 0) -> Heartbeat:
    return Heartbeat(worker_id="w1", incarnation="i1", ts=0.0, attempts=list(attempts),
                     reported_seq=reported_seq)


def test_an_assignment_the_worker_never_heard_of_is_sent_again_after_the_grace() -> None:
    state = state_with(0)
    worker = state.workers["w1"]
    assert judge(state, worker, heartbeat(), now=101.0, grace=GRACE).lost_runs == []
    assert judge(state, worker, heartbeat(), now=103.0, grace=GRACE).lost_runs == [
        ("j1", 0, 0)]


def test_nothing_is_judged_lost_while_the_fold_lags_behind_the_workers_reports() -> None:
    # The worker ran the attempt and reported its exit at sequence 50; the fold is at 3, so
    # the attempt still looks ASSIGNED here. It is not lost: its report is not folded yet.
    state = state_with(0)
    assert state.last_seq == 3
    verdict = judge(state, state.workers["w1"], heartbeat(reported_seq=50), now=500.0,
                    grace=GRACE)
    assert verdict.lost_runs == [] and verdict.unconfirmed_kills == []
    caught_up = judge(state, state.workers["w1"], heartbeat(reported_seq=3), now=500.0,
                      grace=GRACE)
    assert caught_up.lost_runs == [("j1", 0, 0)]


def test_a_running_attempt_listed_by_the_worker_is_left_alone() -> None:
    state = state_with(0)
    state.apply(4, report(0, S.RUNNING))
    verdict = judge(state, state.workers["w1"], heartbeat("j1/0/0"), now=500.0, grace=GRACE)
    assert verdict.strays == [] and verdict.lost_runs == []


def test_an_attempt_the_worker_runs_but_the_fold_does_not_know_is_a_stray() -> None:
    state = state_with(0)
    verdict = judge(state, state.workers["w1"], heartbeat("j1/0/0", "j9/0/0", "j1/0/7"),
                    now=100.5, grace=GRACE)
    assert sorted(verdict.strays) == [("j1", 0, 7), ("j9", 0, 0)]


def test_an_unstarted_attempt_killed_since_gets_its_kill_sent_again() -> None:
    state = state_with(0, 0)
    state.apply(state.last_seq + 1, cancel())
    verdict = judge(state, state.workers["w1"], heartbeat(reported_seq=state.last_seq), now=200.0,
                    grace=GRACE)
    assert sorted(verdict.unconfirmed_kills) == [("j1", 0, 0), ("j1", 1, 0)]
    assert verdict.lost_runs == []
    # and one the worker still lists while being killed is a stray to kill again
    listed = judge(state, state.workers["w1"], heartbeat("j1/0/0"), now=100.5, grace=GRACE)
    assert listed.strays == [("j1", 0, 0)]


def test_a_listed_key_berth_never_makes_is_passed_over() -> None:
    state = state_with(0)
    state.apply(4, report(0, S.RUNNING))
    verdict = judge(state, state.workers["w1"], heartbeat("j1/0/0", "garbage", "j2/x/0", "j3/0/7"),
                    now=500.0, grace=GRACE)
    assert verdict.strays == [("j3", 0, 7)]
    assert verdict.lost_runs == [] and verdict.unconfirmed_kills == []


def test_a_live_attempt_missing_beside_a_stray_is_still_judged() -> None:
    # As many keys listed as live attempts, one of them a stray: the unlisted live attempt
    # must still be found lost (a count of the list alone would pass over it).
    state = state_with(0, 0)
    verdict = judge(state, state.workers["w1"], heartbeat("j1/0/0", "j9/0/0",
                                                          reported_seq=state.last_seq),
                    now=500.0, grace=GRACE)
    assert verdict.strays == [("j9", 0, 0)]
    assert verdict.lost_runs == [("j1", 1, 0)]
