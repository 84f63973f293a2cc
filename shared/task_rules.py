"""The task state machine of the Iris task-state reference, as plain functions over plain data.

The scheduler and the dashboard both fold the event log through `berth.shared.lifecycle`, which
asks these functions every question about what a state change means.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from berth.shared.messages import RetryEvent, RetryPolicy
from berth.shared.states import (
    ATTEMPT_LIVE,
    JOB_TERMINAL,
    JobState,
    JobStates,
    TaskState,
    TaskStates,
)

S = TaskStates  # TaskState's members, looked up faster (states.TaskStates)
J = JobStates

# Task-level transitions, the seed's diagram: dispatch (PENDING -> ASSIGNED), the worker's
# reports in order (ASSIGNED -> BUILDING -> RUNNING -> exit), a build that cannot start the
# command (BUILDING -> FAILED), KILLED from any unfinished state (cancel, job failure,
# timeout), WORKER_FAILED from any state that holds a worker, UNSCHEDULABLE from PENDING
# (scheduling timeout), and the retry edges back to PENDING. One edge the seed lacks:
# ASSIGNED -> RUNNING, a task with no bundle and no setup, whose worker has nothing to build
# and reports no BUILDING. The worker's PENDING is never applied (the seed: it would
# regress an ASSIGNED task). A worker publishes one attempt's reports in order and waits
# for each to be stored, so none is ever skipped.
TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    S.PENDING: frozenset({S.ASSIGNED, S.KILLED, S.UNSCHEDULABLE}),
    S.ASSIGNED: frozenset({S.BUILDING, S.RUNNING, S.KILLED, S.WORKER_FAILED}),
    S.BUILDING: frozenset({S.RUNNING, S.FAILED, S.KILLED, S.WORKER_FAILED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.KILLED, S.WORKER_FAILED}),
    # FAILED and WORKER_FAILED return to PENDING only through a retry (see retry_decision).
    S.FAILED: frozenset({S.PENDING}),
    S.WORKER_FAILED: frozenset({S.PENDING}),
    S.SUCCEEDED: frozenset(),
    S.KILLED: frozenset(),
    S.UNSCHEDULABLE: frozenset(),
}


def can_transition(current: TaskState, new: TaskState) -> bool:
    return new in TRANSITIONS.get(current, frozenset())


# The order a worker reports an attempt's progress in.
PROGRESS = (S.ASSIGNED, S.BUILDING, S.RUNNING)


@functools.cache  # every report of every attempt asks: a lookup, not a walk
def report_path(current: TaskState, reported: TaskState) -> tuple[TaskState, ...] | None:
    """The diagram's steps from `current` to a state a worker reported, or None if the
    report would break the diagram (e.g. a regression). Every step is an edge of
    TRANSITIONS; a report may imply steps its worker did not report separately (a process
    that exits before its RUNNING report was stored is ASSIGNED -> BUILDING -> RUNNING ->
    SUCCEEDED, never a jump)."""
    if can_transition(current, reported):
        return (reported,)
    if current not in PROGRESS:
        return None
    path: list[TaskState] = []
    for step in PROGRESS[PROGRESS.index(current) + 1:]:
        path.append(step)
        if can_transition(step, reported):
            return (*path, reported)
    return None


class RetryDecision(Enum):
    SHOULD_RETRY = "should_retry"
    EXCEEDED_RETRY_LIMIT = "exceeded_retry_limit"
    NOT_RETRIABLE = "not_retriable"


def retry_decision(state: TaskState, counter_after: int, limit: int) -> RetryDecision:
    """`counter_after` is the failure (or preemption) count including this one:
    counter <= limit retries, counter > limit is terminal."""
    if state not in (S.FAILED, S.WORKER_FAILED):
        return RetryDecision.NOT_RETRIABLE
    if counter_after <= limit:
        return RetryDecision.SHOULD_RETRY
    return RetryDecision.EXCEEDED_RETRY_LIMIT


def timeout_outcome(resumable: bool, resumes_after: int, max_resumes: int) -> TaskState:
    """What a task killed at its runtime `timeout` becomes: KILLED (the job ends), or for a
    resumable task with resumes left (`resumes_after` counts this one) FAILED, which the
    fold retries at once on its own budget, never the failure budget. FAILED, because the
    diagram's only way back to PENDING is a retry from FAILED or WORKER_FAILED."""
    if resumable and resumes_after <= max_resumes:
        return S.FAILED
    return S.KILLED


def is_finished(
    state: TaskState,
    failure_count: int,
    max_retries_failure: int,
    preemption_count: int,
    max_retries_preemption: int,
    stopped_with_gang: bool = False,
    retries_ended: bool = False,
) -> bool:
    """The seed's terminal-state summary. `stopped_with_gang`: a gang member brought down
    because another member failed terminally; its preemption budget counts as used up
    (the seed), though its counter still counts only its own preemptions.
    `retries_ended`: its retry policy's duration ran out (retry_plan), whatever its
    budgets say."""
    if state in (S.SUCCEEDED, S.KILLED, S.UNSCHEDULABLE):
        return True
    if state == S.FAILED:
        return retries_ended or failure_count > max_retries_failure
    if state == S.WORKER_FAILED:
        return (stopped_with_gang or retries_ended
                or preemption_count > max_retries_preemption)
    return False


def can_be_scheduled(
    state: TaskState,
    failure_count: int,
    max_retries_failure: int,
    preemption_count: int,
    max_retries_preemption: int,
    stopped_with_gang: bool = False,
    retries_ended: bool = False,
) -> bool:
    """The seed's `can_be_scheduled`: PENDING, or a failure with retry budget left (not
    finished at the task level, so a new attempt may be dispatched)."""
    if state == S.PENDING:
        return True
    return state in (S.FAILED, S.WORKER_FAILED) and not is_finished(
        state, failure_count, max_retries_failure, preemption_count, max_retries_preemption,
        stopped_with_gang, retries_ended,
    )


def derive_job_state(task_states: Iterable[TaskState], max_task_failures: int) -> JobState:
    """Job state from task states, in the seed's order. Tasks in FAILED/WORKER_FAILED are
    here only when finished (a retried task is back in PENDING).

    One refinement of the seed, which would leave such a job PENDING forever: when every task
    is finished and none of rules 1-4 holds, the job is SUCCEEDED if only tolerated FAILED
    tasks remain, and FAILED if a task exhausted its preemption budget."""
    counts: dict[TaskState, int] = {}
    total = 0
    for state in task_states:
        counts[state] = counts.get(state, 0) + 1
        total += 1
    return job_state_from_counts(counts, total, max_task_failures)


def job_state_from_counts(counts: Mapping[TaskState, int], total: int,
                          max_task_failures: int) -> JobState:
    """derive_job_state over `total` tasks given as a count per state."""
    # Called on every task's every state change: plain lookups, no generators (they were a
    # sixth of the fold's time, docs/performance.md).
    get = counts.get
    if total and get(S.SUCCEEDED, 0) == total:
        return J.SUCCEEDED
    if get(S.FAILED, 0) > max_task_failures:
        return J.FAILED
    if get(S.UNSCHEDULABLE, 0):
        return J.UNSCHEDULABLE
    if get(S.KILLED, 0):
        return J.KILLED
    live = get(S.ASSIGNED, 0) + get(S.BUILDING, 0) + get(S.RUNNING, 0)
    if total and not live and not get(S.PENDING, 0):
        return J.FAILED if get(S.WORKER_FAILED, 0) else J.SUCCEEDED
    if live:
        return J.RUNNING
    return J.PENDING


def job_state_may_change(before: TaskState, after: TaskState) -> bool:
    """Whether one task moving from `before` to `after` may change its job's state. The
    job's state counts the live states only together (and master_done looks for SUCCEEDED),
    so a move from one live state to another, a worker's BUILDING or RUNNING report, never
    does: the fold skips the job then (two of a task's four changes)."""
    return before not in ATTEMPT_LIVE or after not in ATTEMPT_LIVE


@functools.cache
def _one_task_job_state(state: TaskState, failures_allowed: int) -> JobState:
    return job_state_from_counts({state: 1}, 1, failures_allowed)


def one_task_job_state(state: TaskState, max_task_failures: int) -> JobState:
    """job_state_from_counts for a job of one task (which keeps no counts)."""
    # One task cannot fail more than once: every allowance past 1 is the same.
    return _one_task_job_state(state, min(max_task_failures, 1))


# --- dependencies and stop criteria (issue 16) ----------------------------------------------

DEPENDENCY = "DEPENDENCY"  # the failure_reason of a job whose `after` dependency failed


class DependencyOutcome(Enum):
    WAIT = "wait"
    READY = "ready"
    BROKEN = "broken"


def dependency_outcome(
    after: Mapping[str, JobState | None], after_any: Mapping[str, JobState | None]
) -> tuple[DependencyOutcome, str]:
    """Whether a job may start, given the states of the jobs it names (None: no such job).
    `after` jobs must succeed, `after_any` jobs only end. Returns the outcome and the job it
    is about: the first one still waited for (WAIT) or the `after` one that failed it
    (BROKEN, which wins over waiting: the job can never start, so it ends at once)."""
    for job_id, state in after.items():
        if state is None or (state in JOB_TERMINAL and state != J.SUCCEEDED):
            return DependencyOutcome.BROKEN, job_id
    for job_id, state in [*after.items(), *after_any.items()]:
        if state is not None and state not in JOB_TERMINAL:
            return DependencyOutcome.WAIT, job_id
    return DependencyOutcome.READY, ""


def master_done(master_done_criteria: bool, task0_state: TaskState) -> bool:
    """stop_criteria master-done: the job is done (SUCCEEDED) once task 0 has succeeded,
    whatever its other tasks are doing."""
    return master_done_criteria and task0_state == S.SUCCEEDED


# --- retry policy by event, with backoff (issue 16) ------------------------------------------


@dataclass(frozen=True)
class RetryPlan:
    """What a retry policy makes of one event: retried (`retry`), placed no earlier than
    `at`; the task's retry window then opens at `since` and it has been retried `retries`
    times under the policy. `retry` False: the window has closed, so the task ends."""

    retry: bool
    at: float
    since: float
    retries: int


def backoff_delay(initial: float, factor: float, maximum: float, retry_number: int) -> float:
    """The wait before retry `retry_number` (1: the first): initial * factor^(n-1), at most
    `maximum`. Computed by logarithms, so the 100000th retry costs what the first does."""
    if initial <= 0 or retry_number <= 1 or factor <= 1:
        return min(initial, maximum)
    steps = retry_number - 1
    growth = steps * math.log(factor)
    if growth >= math.log(maximum) - math.log(initial):
        return maximum
    if growth < 700:  # factor ** steps is a finite float: exact for the usual backoffs
        return min(initial * factor ** steps, maximum)
    return min(math.exp(math.log(initial) + growth), maximum)


def streak_starts_afresh(ran_for: float | None, duration: float | None,
                         backoff_max: float) -> bool:
    """A task whose attempt ran for a whole `duration` (without one: a whole backoff
    `max`) before the event was doing well: its window and backoff start again, so a
    long job preempted weekly is retried each time, while a crash loop's short runs
    never renew its window."""
    if ran_for is None:
        return False
    return ran_for >= (duration if duration is not None else backoff_max)


def retry_plan(policy: RetryPolicy | None, event: RetryEvent, ts: float,
               since: float | None, retries: int, ran_for: float | None = None
               ) -> RetryPlan | None:
    """The policy's answer to `event` at time `ts` (the event's own timestamp, from the
    log), for a task whose window opened at `since` (None: never retried under it) after
    `retries` retries; `ran_for`: how long the attempt that ended had been running (None
    if it never ran). None: the policy does not name the event, so the seed's rule
    applies (retried at once under its budget; a scheduling timeout is final)."""
    if policy is None or event not in policy.on_events:
        return None
    duration, backoff = policy.duration_s, policy.backoff
    if streak_starts_afresh(ran_for, duration, backoff.max_s):
        since, retries = None, 0
    start = ts if since is None else since
    if duration is not None and ts - start >= duration:
        return RetryPlan(retry=False, at=ts, since=start, retries=retries)
    number = retries + 1
    wait = backoff_delay(backoff.initial_s, backoff.factor, backoff.max_s, number)
    return RetryPlan(retry=True, at=ts + wait, since=start, retries=number)


def held_back(backoff: Mapping[tuple[str, int], float], now: float) -> set[tuple[str, int]]:
    """The tasks of `backoff` (ClusterState.backoff: task -> retry_at) that may not be
    placed at `now`; a leader uses the clock it then stamps its assignments with, so the
    fold never finds one of them placed early."""
    return {key for key, at in backoff.items() if at > now}


def backoff_reason(retry_at: float, retries: int, now: float) -> str | None:
    """A pending task's reason while it waits out its backoff (None once it may be placed):
    the try it waits for is attempt `retries + 1`."""
    if retry_at <= now:
        return None
    return f"retrying in {math.ceil(retry_at - now)}s (attempt {retries + 1}, backoff)"
