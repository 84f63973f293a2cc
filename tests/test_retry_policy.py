"""Retry policy by event, with backoff and a duration (issue 16 item 1): the pure rules as
tables, the fold over scenarios, and properties over random timed event sequences."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.cli import _retry_words
from berth.services.dashboard_api.views import task_out
from berth.services.submitter.intake import intake
from berth.shared import durations, task_rules
from berth.shared.lifecycle import ClusterState, Kill
from berth.shared.messages import (
    AnyEvent,
    Backoff,
    Coscheduling,
    RetryEvent,
    RetryPolicy,
    SubmitRejected,
    TaskUnschedulable,
    WorkerDeclaredDead,
)
from berth.shared.state_snapshot import dump, load
from berth.shared.states import ATTEMPT_LIVE, JobState, TaskState
from tests.test_lifecycle import REPORTABLE, assigned, fold, registered, report, submitted

S = TaskState
J = JobState
E = RetryEvent
E_ = TypeVar("E_", bound=msgspec.Struct)


def at(ts: float, event: E_) -> E_:
    return msgspec.structs.replace(event, ts=ts)


def policy(*events: RetryEvent, duration: float | str | None = None, initial: float = 15,
           factor: float = 2, maximum: float = 600) -> RetryPolicy:
    return RetryPolicy(on_events=list(events), duration=duration,
                       backoff=Backoff(initial=initial, factor=factor, max=maximum))


def unschedulable(ts: float, retries: int = 0, index: int = 0, job: str = "j1"
                  ) -> TaskUnschedulable:
    return TaskUnschedulable(job_id=job, task_index=index, reason="no worker has 64 cpu",
                             epoch=1, ts=ts, retries=retries)


def failed_run(attempt: int, start: float, end: float, index: int = 0, job: str = "j1"
               ) -> list[AnyEvent]:
    """An attempt assigned and running at `start` that exits 1 at `end`."""
    return [at(start, assigned(attempt, index, job=job)),
            at(start, report(attempt, S.RUNNING, index=index, job=job)),
            at(end, report(attempt, S.FAILED, 1, index=index, job=job))]


# --- the pure rules ---------------------------------------------------------------------


@pytest.mark.parametrize(("value", "seconds"), [
    (15, 15.0), (0.5, 0.5), ("15s", 15.0), ("10m", 600.0), ("2h", 7200.0), ("1d", 86400.0),
    ("1.5s", 1.5), ("90", 90.0), (" 2h ", 7200.0),
])
def test_durations_read_as_seconds(value: float | str, seconds: float) -> None:
    assert durations.parse(value) == seconds


@pytest.mark.parametrize("value", ["", "2x", "h", "-5s", "1h30m", "1e3s", "15 s"])
def test_what_is_not_a_duration_is_said_so(value: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        durations.parse(value)


@pytest.mark.parametrize(("seconds", "shown"), [
    (15, "15s"), (600, "10m"), (7200, "2h"), (90, "90s"), (1.5, "1.5s"), (86400, "1d")])
def test_durations_are_shown_in_their_largest_exact_unit(seconds: float, shown: str) -> None:
    assert durations.show(seconds) == shown


@pytest.mark.parametrize(("initial", "factor", "maximum", "number", "wait"), [
    (15, 2, 600, 1, 15), (15, 2, 600, 2, 30), (15, 2, 600, 3, 60), (15, 2, 600, 6, 480),
    (15, 2, 600, 7, 600), (15, 2, 600, 100_000, 600),  # capped, and cheap however late
    (15, 1, 600, 9, 15), (0, 2, 600, 5, 0), (10, 3, 1000, 3, 90), (20, 2, 10, 1, 10),
    (1, 100, 366 * 86400, 10**6, 366 * 86400),
])
def test_backoff_times(initial: float, factor: float, maximum: float, number: int,
                       wait: float) -> None:
    assert task_rules.backoff_delay(initial, factor, maximum, number) == wait


@given(st.floats(0, 1000), st.floats(1, 100), st.floats(0, 10**6), st.integers(1, 10**6))
def test_backoff_never_shrinks_and_never_passes_its_max(initial: float, factor: float,
                                                       extra: float, number: int) -> None:
    maximum = initial + extra
    wait = task_rules.backoff_delay(initial, factor, maximum, number)
    assert min(initial, maximum) <= wait <= maximum
    assert task_rules.backoff_delay(initial, factor, maximum, number + 1) >= wait


ALL = (E.ERROR, E.INTERRUPTION, E.NO_CAPACITY)
P = task_rules.RetryPlan


@pytest.mark.parametrize(("pol", "event", "ts", "since", "retries", "ran_for", "plan"), [
    # Without a policy, or for an event it does not name: the seed's rule (None).
    (None, E.ERROR, 100, None, 0, None, None),
    (policy(E.INTERRUPTION), E.ERROR, 100, None, 0, None, None),
    (policy(E.ERROR), E.NO_CAPACITY, 100, None, 0, None, None),
    # The first retry opens the window and waits `initial`.
    (policy(*ALL), E.ERROR, 100, None, 0, 5, P(True, 115, 100, 1)),
    (policy(*ALL), E.INTERRUPTION, 100, None, 0, None, P(True, 115, 100, 1)),
    (policy(*ALL), E.NO_CAPACITY, 100, None, 0, None, P(True, 115, 100, 1)),
    # Later ones wait longer; the window stays where it opened.
    (policy(*ALL, duration="2h"), E.ERROR, 500, 100, 2, 5, P(True, 560, 100, 3)),
    # The duration cut-off: retried just inside it, not at or after it.
    (policy(E.ERROR, duration=60), E.ERROR, 159.5, 100, 1, 1, P(True, 189.5, 100, 2)),
    (policy(E.ERROR, duration=60), E.ERROR, 160, 100, 1, 1, P(False, 160, 100, 1)),
    (policy(E.NO_CAPACITY, duration="1m"), E.NO_CAPACITY, 900, 100, 7, None,
     P(False, 900, 100, 7)),
    # An attempt that ran a whole duration starts afresh: a new window, the first wait.
    (policy(E.INTERRUPTION, duration=60), E.INTERRUPTION, 900, 100, 7, 60,
     P(True, 915, 900, 1)),
    (policy(E.INTERRUPTION, duration=60), E.INTERRUPTION, 900, 100, 7, 59,
     P(False, 900, 100, 7)),
    # Without a duration, a run as long as the backoff's max starts afresh.
    (policy(E.INTERRUPTION), E.INTERRUPTION, 10**6, 100, 30, 600, P(True, 10**6 + 15, 10**6, 1)),
    (policy(E.INTERRUPTION), E.INTERRUPTION, 10**6, 100, 30, 599, P(True, 10**6 + 600, 100, 31)),
])
def test_retry_plan_table(pol: RetryPolicy | None, event: RetryEvent, ts: float,
                          since: float | None, retries: int, ran_for: float | None,
                          plan: task_rules.RetryPlan | None) -> None:
    assert task_rules.retry_plan(pol, event, ts, since, retries, ran_for) == plan


@pytest.mark.parametrize(("retry_at", "retries", "now", "reason"), [
    (140, 2, 100, "retrying in 40s (attempt 3, backoff)"),
    (100.2, 0, 100, "retrying in 1s (attempt 1, backoff)"),
    (100, 1, 100, None), (0, 0, 100, None)])
def test_backoff_reason(retry_at: float, retries: int, now: float, reason: str | None) -> None:
    assert task_rules.backoff_reason(retry_at, retries, now) == reason


@pytest.mark.parametrize(("retry", "said"), [
    (None, ""),
    ({"on_events": ["error", "interruption"], "duration": "2h",
      "backoff": {"initial": "15s", "factor": 2, "max": "10m"}},
     "retries on error, interruption for 2h after its first retry, waiting 15s, x2 each "
     "time up to 10m before each"),
    ({"on_events": ["interruption"], "backoff": {"initial": 5, "factor": 1}},
     "retries on interruption with no time limit, waiting 5s before each"),
])
def test_berth_submit_says_what_the_policy_will_do(retry: dict[str, Any] | None,
                                                    said: str) -> None:
    spec = {"name": "x", "command": ["x"], "max_retries_failure": 3, "retry": retry}
    assert _retry_words(json.dumps(spec).encode()) == said


@pytest.mark.parametrize(("retry", "said"), [
    ({"on_events": []}, "Expected `array` of length >= 1 - at `$.retry.on_events`"),
    ({"on_events": ["oom"]}, "Invalid enum value 'oom' - at `$.retry.on_events[0]`"),
    ({"on_events": ["interruption", "interruption"]}, "retry.on_events: events must be unique"),
    ({"on_events": ["interruption"], "duration": "2 hours"},
     "retry.duration: '2 hours' is not a duration (seconds, or a number with s, m, h or d"),
    ({"on_events": ["interruption"], "duration": 0}, "retry.duration: must be more than 0"),
    ({"on_events": ["interruption"], "duration": "400d"},
     "retry.duration: '400d' is longer than 366 days"),
    ({"on_events": ["interruption"], "duration": True},
     "Expected `float | str | null`, got `bool` - at `$.retry.duration`"),
    ({"on_events": ["interruption"], "backoff": {"initial": "1m", "max": "30s"}},
     "retry.backoff.max: '30s' is less than backoff.initial '1m'"),
    ({"on_events": ["interruption"], "backoff": {"factor": 0.5}},
     "Expected `float` >= 1.0 - at `$.retry.backoff.factor`"),
    ({"on_events": ["interruption"], "backoff": {"jitter": 1}},
     "Object contains unknown field `jitter` - at `$.retry.backoff`"),
    ({"on_events": ["error"]}, "retry.on_events: 'error' retries nothing with "
     "max_retries_failure 0; set max_retries_failure"),
    ({"on_events": ["no-capacity"]}, "retry.on_events: 'no-capacity' needs a "
     "scheduling_timeout"),
])
def test_a_bad_policy_is_one_line_naming_the_field(retry: dict[str, Any], said: str) -> None:
    payload = json.dumps({"name": "x", "command": ["x"], "retry": retry}).encode()
    outcome = intake(payload, 7, 0, 1 << 20)
    assert isinstance(outcome, SubmitRejected), outcome
    assert said in outcome.reason and "\n" not in outcome.reason, outcome.reason


# --- the fold -----------------------------------------------------------------------------


def test_an_error_waits_out_its_backoff_pending_and_an_early_assignment_is_void() -> None:
    events: list[AnyEvent] = [
        registered(), submitted(max_retries_failure=3, retry=policy(E.ERROR, initial=15)),
        *failed_run(0, 10, 20)]
    state, _ = fold(events)
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.PENDING and task.failure_count == 1 and task.retries == 1
    assert (task.retry_at, task.retry_since, task.pending_since) == (35, 20, 35)
    assert state.backoff == {("j1", 0): 35} and ("j1", 0) in state.pending
    shown = task_out(task, now=31)
    assert shown.pending_reason == "retrying in 4s (attempt 2, backoff)"
    assert shown.retry_at == 35 and task_out(task, now=35).pending_reason == ""

    # An assignment stamped before its retry_at (no leader makes one) starts nothing.
    state, effects = fold([*events, at(34.9, assigned(1))])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.PENDING and state.backoff == {("j1", 0): 35}
    assert [(k.attempt_id, k.reason) for k in effects if isinstance(k, Kill)] == [
        (1, "task is pending")]
    # At its retry_at it is placed, and leaves the backoff.
    state, _ = fold([*events, at(35, assigned(1))])
    assert state.jobs["j1"].tasks[0].state == S.ASSIGNED and not state.backoff


def test_each_retry_waits_longer_until_the_duration_runs_out() -> None:
    events: list[AnyEvent] = [registered(), submitted(
        max_retries_failure=10, retry=policy(E.ERROR, duration="2m", initial=15, maximum=40))]
    # Failures at 20, then each 1 s after its retry_at: waits 15, 30, 40 (capped), ...
    clock, waits, attempt = 20.0, [], 0
    events += failed_run(attempt, clock - 1, clock)
    while True:
        state, _ = fold(events)
        task = state.jobs["j1"].tasks[0]
        if task.state != S.PENDING:
            break
        waits.append(task.retry_at - clock)
        attempt += 1
        clock = task.retry_at + 1
        events += failed_run(attempt, task.retry_at, clock)
    # Failures at 20, 36, 67 and 108 are retried; the one at 149 is past 2m after 20.
    assert waits == [15, 30, 40, 40]
    assert task.state == S.FAILED and task.retries_ended and task.failure_count == 5
    assert state.jobs["j1"].state == J.FAILED and not state.pending and not state.backoff
    assert task_rules.is_finished(task.state, task.failure_count, 10, 0, 100,
                                  retries_ended=task.retries_ended)


def test_an_interruption_waits_under_the_policy_and_is_at_once_without_it() -> None:
    def after_worker_death(**spec: Any) -> ClusterState:
        state, _ = fold([registered(), submitted(**spec), at(5, assigned(0)),
                         at(6, report(0, S.RUNNING)),
                         WorkerDeclaredDead(worker_id="w1", incarnation="i1", ts=50)])
        return state

    state = after_worker_death(retry=policy(E.INTERRUPTION, initial=15))
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.PENDING and task.preemption_count == 1
    assert task.retry_at == 65 and state.backoff == {("j1", 0): 65}
    for spec in ({}, {"max_retries_failure": 1, "retry": policy(E.ERROR)}):
        state = after_worker_death(**spec)
        task = state.jobs["j1"].tasks[0]
        assert task.state == S.PENDING and task.retry_at == 0 and not state.backoff
        assert task.pending_since == 50


def test_a_scheduling_timeout_is_a_retry_under_no_capacity_until_the_duration_ends() -> None:
    events: list[AnyEvent] = [registered(), at(0, submitted(
        scheduling_timeout=10, retry=policy(E.NO_CAPACITY, duration=60, initial=5)))]
    state, _ = fold([*events, unschedulable(10)])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.PENDING and task.retries == 1 and task.retry_at == 15
    assert task.pending_since == 15  # the next timeout counts from the end of the wait
    assert task.error.startswith("no worker")
    # The leader folds its own event at once, then again from the log: one retry only.
    state, _ = fold([*events, unschedulable(10), unschedulable(10)])
    assert state.jobs["j1"].tasks[0].retries == 1
    state, _ = fold([*events, unschedulable(10), unschedulable(25, 1), unschedulable(45, 2),
                     unschedulable(75, 3)])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.UNSCHEDULABLE and task.retries == 3 and task.retries_ended
    assert state.jobs["j1"].state == J.UNSCHEDULABLE and not state.backoff
    # Without the policy a timeout is final, as in the seed.
    state, _ = fold([registered(), submitted(scheduling_timeout=10), unschedulable(10)])
    assert state.jobs["j1"].tasks[0].state == S.UNSCHEDULABLE


def test_a_gang_waits_whole_for_the_backoff_of_its_member_that_failed() -> None:
    gang = Coscheduling(group_by="rack")
    events: list[AnyEvent] = [registered(), submitted(
        "j1", 2, coscheduling=gang, max_retries_failure=2, retry=policy(E.ERROR, initial=15))]
    events += [at(1, assigned(0, index=i)) for i in (0, 1)]
    events += [at(2, report(0, S.RUNNING, index=i)) for i in (0, 1)]
    events += [at(30, report(0, S.FAILED, 1, index=1))]
    state, _ = fold(events)
    tasks = state.jobs["j1"].tasks
    assert [t.state for t in tasks] == [S.PENDING, S.PENDING]
    assert state.backoff == {("j1", 0): 45, ("j1", 1): 45}
    assert tasks[0].preemption_count == 1 and tasks[0].retries == 0  # retried with it


def test_a_backoff_wait_survives_a_snapshot() -> None:
    """A new leader or a restarted projection knows the wait from the log alone."""
    events: list[AnyEvent] = [registered(), submitted(
        "j1-abcd", max_retries_failure=1, retry=policy(E.ERROR, initial=15)),
        *failed_run(0, 10, 20, job="j1-abcd")]
    state, _ = fold(events)
    restored = load(dump(state, "s"), "s", state.last_seq)
    assert restored.backoff == {("j1-abcd", 0): 35}
    assert restored.jobs["j1-abcd"].tasks[0].retry_at == 35


# --- properties over random timed sequences -----------------------------------------------


@st.composite
def timed_sequences(draw: st.DrawFn) -> list[AnyEvent]:
    """Jobs with random policies, then random assignments, reports, worker deaths and
    timeouts at increasing times (including assignments no leader would make)."""
    names = draw(st.lists(st.sampled_from(ALL), min_size=1, max_size=3, unique=True))
    pol = policy(*names, duration=draw(st.sampled_from([None, 30, 100])),
                 initial=draw(st.sampled_from([0, 5, 15])), factor=draw(st.sampled_from([1, 2])),
                 maximum=40)
    gang = draw(st.sampled_from([None, Coscheduling(group_by="rack")]))
    events: list[AnyEvent] = [
        registered(), submitted("j1", 2, retry=pol, max_retries_failure=3,
                                max_retries_preemption=3, scheduling_timeout=10,
                                max_task_failures=1),
        submitted("j2", 2, retry=pol, max_retries_failure=3, scheduling_timeout=10,
                  coscheduling=gang)]
    clock, incarnation = 0.0, 1
    for _ in range(draw(st.integers(0, 40))):
        clock += draw(st.sampled_from([0, 1, 7, 20]))
        job, index = draw(st.sampled_from(["j1", "j2"])), draw(st.integers(0, 1))
        kind = draw(st.sampled_from(["assign", "assign", "report", "report", "dead",
                                     "unschedulable"]))
        inc = f"i{incarnation}"
        event: AnyEvent
        if kind == "assign":
            event = assigned(draw(st.integers(0, 5)), index, incarnation=inc, job=job)
        elif kind == "report":
            event = report(draw(st.integers(0, 5)), draw(st.sampled_from(REPORTABLE)),
                           draw(st.sampled_from([0, 1])), index, job=job)
        elif kind == "dead":
            events.append(at(clock, WorkerDeclaredDead(worker_id="w1", incarnation=inc)))
            incarnation += 1
            event = registered("w1", f"i{incarnation}")
        else:
            event = unschedulable(clock, draw(st.integers(0, 3)), index, job)
        events.append(at(clock, event))
    return events


@settings(max_examples=80, deadline=None)
@given(timed_sequences())
def test_retry_invariants(events: list[AnyEvent]) -> None:
    state = ClusterState()
    for seq, event in enumerate(events, start=1):
        state.apply(seq, event)
        # The backoff holds exactly the pending tasks that wait for a time.
        assert state.backoff == {k: t.retry_at for k in state.pending
                                 if (t := state.jobs[k[0]].tasks[k[1]]).retry_at}
        for job in state.jobs.values():
            spec = job.spec
            pol = spec.retry
            assert pol is not None
            for task in job.tasks:
                # Nothing starts before its retry_at.
                if task.state in ATTEMPT_LIVE:
                    current = task.current_attempt
                    assert current is not None and current.assigned_at >= task.retry_at
                # Exactly the schedulable tasks wait for placement.
                schedulable = task_rules.can_be_scheduled(
                    task.state, task.failure_count, spec.max_retries_failure,
                    task.preemption_count, spec.max_retries_preemption,
                    task.stopped_with_gang, task.retries_ended)
                assert (task.key in state.pending) == schedulable
                # A wait is never longer than the backoff's max, and no retry was decided
                # after the window closed.
                if task.key in state.backoff:
                    assert task.retry_since is not None and task.retries >= 1
                    assert task.retry_at - pol.backoff.max_s <= event.ts
                    if (d := pol.duration_s) is not None:
                        assert task.retry_at < task.retry_since + d + pol.backoff.max_s
                if task.retries_ended:
                    assert task.state not in (S.PENDING, *ATTEMPT_LIVE)


@settings(max_examples=50, deadline=None)
@given(timed_sequences(), st.data())
def test_redelivery_and_snapshots_change_nothing_under_retry_policies(
        events: list[AnyEvent], data: st.DataObject) -> None:
    straight, _ = fold(events)
    cut = data.draw(st.integers(0, len(events)))
    first = ClusterState()
    for seq, event in enumerate(events[:cut], start=1):
        first.apply(seq, event)
        first.apply(seq, event)  # at-least-once delivery
    resumed = load(dump(first, "events@t"), "events@t", cut)
    for seq, event in enumerate(events[cut:], start=cut + 1):
        resumed.apply(seq, event)
    # Compared as plain data: the test builds some float fields from ints (15 == 15.0).
    def plain(state: ClusterState) -> object:
        return msgspec.msgpack.decode(dump(state, "events@t"))

    assert plain(resumed) == plain(straight)
    assert resumed.backoff == straight.backoff


def test_a_leader_holds_back_exactly_the_tasks_whose_retry_at_is_ahead_of_its_clock() -> None:
    backoff = {("j1", 0): 35.0, ("j1", 1): 30.0, ("j2", 0): 36.0}
    assert task_rules.held_back(backoff, 35.0) == {("j2", 0)}
    assert task_rules.held_back(backoff, 29.0) == set(backoff)
    assert task_rules.held_back({}, 0.0) == set()


@pytest.mark.parametrize(("state", "ended", "finished"), [
    (S.FAILED, False, False), (S.FAILED, True, True),  # budget left, window closed
    (S.WORKER_FAILED, False, False), (S.WORKER_FAILED, True, True),
    (S.PENDING, True, False), (S.RUNNING, True, False)])
def test_a_task_whose_window_closed_is_finished_with_budget_left(
        state: TaskState, ended: bool, finished: bool) -> None:
    assert task_rules.is_finished(state, 1, 5, 1, 5, retries_ended=ended) is finished
    assert task_rules.can_be_scheduled(state, 1, 5, 1, 5, retries_ended=ended) is (
        state in (S.PENDING, S.FAILED, S.WORKER_FAILED) and not finished)
