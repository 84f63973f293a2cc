"""Table-driven tests of the seed's state table, retry rules and job-state derivation."""

from __future__ import annotations

import pytest

from shared import task_rules
from shared.states import JobState, TaskState

S = TaskState


def test_proto_values_match_the_seed() -> None:
    assert {s.name: s.value for s in TaskState} == {
        "UNSPECIFIED": 0, "PENDING": 1, "BUILDING": 2, "RUNNING": 3, "SUCCEEDED": 4,
        "FAILED": 5, "KILLED": 6, "WORKER_FAILED": 7, "UNSCHEDULABLE": 8, "ASSIGNED": 9,
    }
    assert S.WORKER_FAILED.display == "worker_failed"


@pytest.mark.parametrize(
    ("current", "new", "allowed"),
    [
        (S.PENDING, S.ASSIGNED, True),
        (S.ASSIGNED, S.BUILDING, True),
        (S.BUILDING, S.RUNNING, True),
        (S.RUNNING, S.SUCCEEDED, True),
        (S.RUNNING, S.FAILED, True),
        (S.RUNNING, S.WORKER_FAILED, True),
        (S.FAILED, S.PENDING, True),
        (S.WORKER_FAILED, S.PENDING, True),
        (S.PENDING, S.UNSCHEDULABLE, True),
        (S.RUNNING, S.KILLED, True),
        (S.ASSIGNED, S.PENDING, False),  # a worker's PENDING never regresses ASSIGNED
        (S.RUNNING, S.BUILDING, False),
        (S.SUCCEEDED, S.FAILED, False),
        (S.KILLED, S.PENDING, False),  # never retried
        (S.UNSCHEDULABLE, S.PENDING, False),  # never retried
        (S.PENDING, S.RUNNING, False),  # must be dispatched first
        (S.SUCCEEDED, S.PENDING, False),
    ],
)
def test_transitions(current: TaskState, new: TaskState, allowed: bool) -> None:
    assert task_rules.can_transition(current, new) is allowed


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
