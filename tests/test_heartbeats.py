"""The leader's reading of a heartbeat: what to kill, and what to send again; and the
heartbeat pace it asks of the workers."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from berth.services.scheduler.heartbeats import judge, pace
from berth.shared.config import Settings
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


@pytest.mark.parametrize(("live", "interval", "rate", "longest", "expected"), [
    (0, 1.0, 2000, 3.75, 1.0),  # no workers yet
    (1000, 1.0, 2000, 3.75, 1.0),  # 1,000 a second at 1 s: within the rate
    (2000, 1.0, 2000, 3.75, 1.0),
    (2001, 1.0, 2000, 3.75, 1.5),  # just over: the next step
    (5000, 1.0, 2000, 3.75, 2.5),
    (10000, 1.0, 2000, 3.75, 3.75),  # 5 s wanted, capped so two may be lost
    (10000, 1.0, 0, 3.75, 1.0),  # rate 0: the configured interval
    (10000, 5.0, 2000, 3.75, 5.0),  # never below the configured interval
    (300, 0.2, 1000, 3.75, 0.5),  # 1,500 a second at 0.2 s: one step
])
def test_the_pace_slows_heartbeats_to_the_rate_within_the_bounds(
        live: int, interval: float, rate: float, longest: float, expected: float) -> None:
    assert pace(live, interval, rate, longest) == expected


@pytest.mark.parametrize(("live", "expected"), [
    (1000, 1.0),  # what 1,000 hosts cost at 1 s is the budget: nothing changes up to here
    (1001, 1.5),
    (2500, 2.5),
    (3750, 3.75),  # the fence's bound (a third of 15 s - 3.75 s), reached
    (10000, 3.75),  # past it the rate grows with the hosts: raise BERTH_WORKER_DEAD_AFTER
])
def test_the_default_rate_keeps_a_large_cluster_at_what_1000_hosts_cost(
        live: int, expected: float, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BERTH_HEARTBEAT_RATE", "BERTH_HEARTBEAT_INTERVAL", "BERTH_WORKER_DEAD_AFTER",
                 "BERTH_FENCE_MARGIN"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings.from_env()
    assert pace(live, settings.heartbeat_interval, settings.heartbeat_rate,
                settings.longest_heartbeat_interval) == expected


def test_a_worker_takes_the_pace_asked_within_its_own_bounds() -> None:
    settings = dataclasses.replace(Settings.from_env(), heartbeat_interval=1.0,
                                   worker_dead_after=15.0, fence_margin=3.75)
    assert settings.longest_heartbeat_interval == 3.75  # a third of the 11.25 s fence
    assert settings.heartbeat_interval_asked(0.0) == 1.0  # nothing asked
    assert settings.heartbeat_interval_asked(2.5) == 2.5
    assert settings.heartbeat_interval_asked(0.1) == 1.0  # never faster than its own
    assert settings.heartbeat_interval_asked(60.0) == 3.75  # nor past its fence's third
    slow = dataclasses.replace(settings, heartbeat_interval=5.0)
    assert slow.heartbeat_interval_asked(2.0) == slow.heartbeat_interval_asked(60.0) == 5.0


def test_an_answer_cannot_carry_an_interval_that_would_stop_heartbeats() -> None:
    from berth.shared.messages import HeartbeatAck, heartbeat_ack_decoder

    assert heartbeat_ack_decoder.decode(b'{"epoch": 3, "heartbeat_interval": 2.5}') == \
        HeartbeatAck(epoch=3, heartbeat_interval=2.5)
    for bad in (b"-1", b"1e9", b"NaN", b'"2"'):
        with pytest.raises(msgspec.DecodeError):
            heartbeat_ack_decoder.decode(b'{"epoch": 3, "heartbeat_interval": ' + bad + b"}")
