"""Table-driven tests of the seed's state table, retry rules and job-state derivation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from berth.shared import task_rules
from berth.shared.states import ATTEMPT_TERMINAL, JobState, TaskState

S = TaskState


def test_proto_values_match_the_seed() -> None:
    assert {s.name: s.value for s in TaskState} == {
        "UNSPECIFIED": 0, "PENDING": 1, "BUILDING": 2, "RUNNING": 3, "SUCCEEDED": 4,
        "FAILED": 5, "KILLED": 6, "WORKER_FAILED": 7, "UNSCHEDULABLE": 8, "ASSIGNED": 9,
    }
    assert S.WORKER_FAILED.display == "worker_failed"


# Every edge of the seed's diagram, and no other: the worker's progress, exits from RUNNING
# (and a build that cannot start its command), KILLED from every unfinished state,
# WORKER_FAILED from every state that holds a worker, the scheduling timeout, the retries;
# and the one edge berth adds, ASSIGNED -> RUNNING: a task with nothing to build.
SEED_EDGES = {
    (S.PENDING, S.ASSIGNED), (S.ASSIGNED, S.BUILDING), (S.BUILDING, S.RUNNING),
    (S.ASSIGNED, S.RUNNING),
    (S.RUNNING, S.SUCCEEDED), (S.RUNNING, S.FAILED), (S.BUILDING, S.FAILED),
    (S.PENDING, S.KILLED), (S.ASSIGNED, S.KILLED), (S.BUILDING, S.KILLED),
    (S.RUNNING, S.KILLED),
    (S.ASSIGNED, S.WORKER_FAILED), (S.BUILDING, S.WORKER_FAILED),
    (S.RUNNING, S.WORKER_FAILED),
    (S.PENDING, S.UNSCHEDULABLE),
    (S.FAILED, S.PENDING), (S.WORKER_FAILED, S.PENDING),
}
STATES = [s for s in TaskState if s != S.UNSPECIFIED]


@pytest.mark.parametrize("current", STATES, ids=lambda s: s.display)
@pytest.mark.parametrize("new", STATES, ids=lambda s: s.display)
def test_transitions_are_exactly_the_seed_diagram(current: TaskState, new: TaskState) -> None:
    assert task_rules.can_transition(current, new) is ((current, new) in SEED_EDGES)


# The seed's state table: terminal (at the attempt level) and retriable, row by row.
@pytest.mark.parametrize(
    ("state", "proto", "terminal", "retriable"),
    [
        (S.PENDING, 1, False, False),
        (S.ASSIGNED, 9, False, False),
        (S.BUILDING, 2, False, False),
        (S.RUNNING, 3, False, False),
        (S.SUCCEEDED, 4, True, False),
        (S.FAILED, 5, True, True),
        (S.KILLED, 6, True, False),
        (S.WORKER_FAILED, 7, True, True),
        (S.UNSCHEDULABLE, 8, True, False),
    ],
    ids=lambda v: v.display if isinstance(v, TaskState) else None,
)
def test_state_table(state: TaskState, proto: int, terminal: bool, retriable: bool) -> None:
    assert state.value == proto
    assert (state in ATTEMPT_TERMINAL) is terminal
    assert (task_rules.retry_decision(state, 1, 1) == task_rules.RetryDecision.SHOULD_RETRY
            ) is retriable
    # A terminal state leaves only through a retry.
    if terminal:
        assert task_rules.TRANSITIONS[state] <= {S.PENDING}
        assert bool(task_rules.TRANSITIONS[state]) is retriable


@pytest.mark.parametrize(
    ("current", "reported", "path"),
    [
        (S.ASSIGNED, S.BUILDING, [S.BUILDING]),
        (S.ASSIGNED, S.RUNNING, [S.RUNNING]),  # nothing to build: no BUILDING report
        (S.ASSIGNED, S.SUCCEEDED, [S.BUILDING, S.RUNNING, S.SUCCEEDED]),
        (S.ASSIGNED, S.FAILED, [S.BUILDING, S.FAILED]),  # cannot start the command
        (S.ASSIGNED, S.KILLED, [S.KILLED]),  # killed before it started
        (S.BUILDING, S.SUCCEEDED, [S.RUNNING, S.SUCCEEDED]),
        (S.RUNNING, S.BUILDING, None),  # a regression
        (S.RUNNING, S.RUNNING, None),
        (S.SUCCEEDED, S.FAILED, None),
        (S.KILLED, S.KILLED, None),  # a finished task is final
        (S.PENDING, S.RUNNING, None),  # never dispatched
    ],
)
def test_report_path(current: TaskState, reported: TaskState, path: list[TaskState] | None
                     ) -> None:
    assert task_rules.report_path(current, reported) == (tuple(path) if path else None)
    for a, b in zip([current, *(path or [])], path or [], strict=False):
        assert task_rules.can_transition(a, b)


@pytest.mark.parametrize(
    ("state", "counter", "limit", "decision"),
    [
        (S.FAILED, 1, 0, task_rules.RetryDecision.EXCEEDED_RETRY_LIMIT),  # default: no retries
        (S.FAILED, 1, 2, task_rules.RetryDecision.SHOULD_RETRY),
        (S.FAILED, 2, 2, task_rules.RetryDecision.SHOULD_RETRY),  # counter <= limit retries
        (S.FAILED, 3, 2, task_rules.RetryDecision.EXCEEDED_RETRY_LIMIT),
        (S.WORKER_FAILED, 100, 100, task_rules.RetryDecision.SHOULD_RETRY),
        (S.WORKER_FAILED, 101, 100, task_rules.RetryDecision.EXCEEDED_RETRY_LIMIT),
        (S.KILLED, 1, 5, task_rules.RetryDecision.NOT_RETRIABLE),
        (S.UNSCHEDULABLE, 1, 5, task_rules.RetryDecision.NOT_RETRIABLE),
        (S.SUCCEEDED, 1, 5, task_rules.RetryDecision.NOT_RETRIABLE),
    ],
)
def test_retry_decision(state: TaskState, counter: int, limit: int,
                        decision: task_rules.RetryDecision) -> None:
    assert task_rules.retry_decision(state, counter, limit) == decision


@pytest.mark.parametrize(
    ("state", "failures", "max_f", "preemptions", "max_p", "finished"),
    [
        (S.SUCCEEDED, 0, 0, 0, 100, True),
        (S.KILLED, 0, 0, 0, 100, True),
        (S.UNSCHEDULABLE, 0, 0, 0, 100, True),
        (S.FAILED, 1, 0, 0, 100, True),
        (S.FAILED, 1, 1, 0, 100, False),
        (S.WORKER_FAILED, 0, 0, 100, 100, False),
        (S.WORKER_FAILED, 0, 0, 101, 100, True),
        (S.RUNNING, 0, 0, 0, 100, False),
        (S.PENDING, 0, 0, 0, 100, False),
    ],
)
def test_is_finished(state: TaskState, failures: int, max_f: int, preemptions: int, max_p: int,
                     finished: bool) -> None:
    assert task_rules.is_finished(state, failures, max_f, preemptions, max_p) is finished


@pytest.mark.parametrize(
    ("state", "failures", "max_f", "preemptions", "max_p", "schedulable"),
    [
        (S.PENDING, 0, 0, 0, 100, True),
        (S.FAILED, 1, 1, 0, 100, True),  # the seed: terminal attempt, budget left
        (S.FAILED, 2, 1, 0, 100, False),
        (S.WORKER_FAILED, 0, 0, 3, 100, True),
        (S.WORKER_FAILED, 0, 0, 101, 100, False),
        (S.ASSIGNED, 0, 0, 0, 100, False),
        (S.RUNNING, 0, 0, 0, 100, False),
        (S.SUCCEEDED, 0, 0, 0, 100, False),
        (S.KILLED, 0, 0, 0, 100, False),
        (S.UNSCHEDULABLE, 0, 0, 0, 100, False),
    ],
)
def test_can_be_scheduled(state: TaskState, failures: int, max_f: int, preemptions: int,
                          max_p: int, schedulable: bool) -> None:
    assert task_rules.can_be_scheduled(state, failures, max_f, preemptions, max_p) is schedulable


@pytest.mark.parametrize(
    ("tasks", "max_task_failures", "expected"),
    [
        ([S.SUCCEEDED, S.SUCCEEDED], 0, JobState.SUCCEEDED),
        ([S.SUCCEEDED, S.FAILED], 0, JobState.FAILED),  # the seed's example: not RUNNING
        ([S.RUNNING, S.FAILED], 0, JobState.FAILED),
        ([S.RUNNING, S.FAILED], 1, JobState.RUNNING),  # tolerated
        ([S.FAILED, S.FAILED, S.RUNNING], 1, JobState.FAILED),
        ([S.UNSCHEDULABLE, S.RUNNING], 0, JobState.UNSCHEDULABLE),
        ([S.FAILED, S.UNSCHEDULABLE], 0, JobState.FAILED),  # FAILED outranks UNSCHEDULABLE
        ([S.KILLED, S.RUNNING], 0, JobState.KILLED),
        ([S.UNSCHEDULABLE, S.KILLED], 0, JobState.UNSCHEDULABLE),
        ([S.ASSIGNED, S.PENDING], 0, JobState.RUNNING),
        ([S.BUILDING], 0, JobState.RUNNING),
        ([S.PENDING, S.PENDING], 0, JobState.PENDING),
        ([S.SUCCEEDED, S.PENDING], 0, JobState.PENDING),  # the seed's default rule
        # Refinement: every task finished, nothing beyond tolerance.
        ([S.SUCCEEDED, S.FAILED], 1, JobState.SUCCEEDED),
        ([S.SUCCEEDED, S.WORKER_FAILED], 0, JobState.FAILED),
    ],
)
def test_job_state_derivation(tasks: list[TaskState], max_task_failures: int,
                              expected: JobState) -> None:
    assert task_rules.derive_job_state(tasks, max_task_failures) == expected


@pytest.mark.parametrize(("resumable", "resumes_after", "max_resumes", "outcome"), [
    (False, 1, 10, S.KILLED),
    (True, 1, 10, S.FAILED),
    (True, 10, 10, S.FAILED),
    (True, 11, 10, S.KILLED),
    (True, 1, 0, S.KILLED),
])
def test_a_timeout_is_a_retry_only_for_a_resumable_task_with_resumes_left(
        resumable: bool, resumes_after: int, max_resumes: int, outcome: TaskState) -> None:
    assert task_rules.timeout_outcome(resumable, resumes_after, max_resumes) == outcome


def test_a_one_task_jobs_state_is_its_counts_state() -> None:
    for state in TaskState:
        for allowed in (0, 1, 2, 50):
            assert task_rules.one_task_job_state(state, allowed) == \
                task_rules.job_state_from_counts({state: 1}, 1, allowed), (state, allowed)


@given(st.lists(st.sampled_from(list(TaskState)), min_size=1, max_size=12),
       st.integers(0, 11), st.sampled_from(list(TaskState)), st.integers(0, 3))
def test_a_move_the_fold_skips_never_changes_the_jobs_state(
        tasks: list[TaskState], which: int, after: TaskState, max_task_failures: int) -> None:
    """The fold does not work a job's state out again when job_state_may_change says a
    task's move cannot change it: it must then be the same before and after the move."""
    which %= len(tasks)
    before = tasks[which]
    moved = [*tasks[:which], after, *tasks[which + 1:]]
    if not task_rules.job_state_may_change(before, after):
        assert (task_rules.derive_job_state(moved, max_task_failures)
                == task_rules.derive_job_state(tasks, max_task_failures))
        if which == 0:  # stop_criteria master-done looks at task 0 alone
            assert not task_rules.master_done(True, before)
            assert not task_rules.master_done(True, after)


def test_only_moves_between_live_states_are_skipped() -> None:
    live = {S.ASSIGNED, S.BUILDING, S.RUNNING}
    for before in TaskState:
        for after in TaskState:
            assert task_rules.job_state_may_change(before, after) == (
                before not in live or after not in live), (before, after)
