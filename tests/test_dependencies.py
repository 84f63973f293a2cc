"""Job dependencies (`after`, `after_any`) and stop criteria (`master-done`) in the fold: the
pure rules as tables, then the fold over event sequences (issue 16 items 2 and 5)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.cli import _waits_for
from berth.services.submitter.intake import intake
from berth.shared import task_rules
from berth.shared.lifecycle import ClusterState, Kill
from berth.shared.messages import AnyEvent, StopCriteria, SubmitRejected
from berth.shared.state_snapshot import dump, load
from berth.shared.states import ATTEMPT_LIVE, JOB_TERMINAL, JobState, TaskState
from tests.test_lifecycle import (
    REPORTABLE,
    assigned,
    cancel,
    fold,
    registered,
    report,
    submitted,
)

S = TaskState
J = JobState
D = task_rules.DependencyOutcome


@pytest.mark.parametrize(("after", "after_any", "expected"), [
    ({}, {}, (D.READY, "")),
    ({"a": J.SUCCEEDED}, {}, (D.READY, "")),
    ({"a": J.RUNNING}, {}, (D.WAIT, "a")),
    ({"a": J.PENDING, "b": J.FAILED}, {}, (D.BROKEN, "b")),
    ({"a": J.KILLED}, {}, (D.BROKEN, "a")),
    ({"a": J.UNSCHEDULABLE}, {}, (D.BROKEN, "a")),
    ({"a": None}, {}, (D.BROKEN, "a")),
    ({}, {"a": J.FAILED, "b": J.KILLED}, (D.READY, "")),
    ({}, {"a": J.FAILED, "b": J.RUNNING}, (D.WAIT, "b")),
    ({"a": J.SUCCEEDED}, {"b": J.PENDING}, (D.WAIT, "b")),
    ({"a": J.RUNNING}, {"b": J.FAILED}, (D.WAIT, "a")),
])
def test_dependency_outcome_table(after: dict[str, JobState | None],
                                  after_any: dict[str, JobState | None],
                                  expected: tuple[task_rules.DependencyOutcome, str]) -> None:
    assert task_rules.dependency_outcome(after, after_any) == expected


@pytest.mark.parametrize(("criteria", "task0", "done"), [
    (True, S.SUCCEEDED, True), (True, S.RUNNING, False), (True, S.FAILED, False),
    (False, S.SUCCEEDED, False),
])
def test_master_done_table(criteria: bool, task0: TaskState, done: bool) -> None:
    assert task_rules.master_done(criteria, task0) is done


def run_to(job: str, attempt: int, end: TaskState, index: int = 0) -> list[AnyEvent]:
    code = 0 if end == S.SUCCEEDED else 1
    return [assigned(attempt, index=index, job=job),
            report(attempt, S.RUNNING, index=index, job=job),
            report(attempt, end, code, index=index, job=job)]


def test_an_after_job_waits_unplaced_then_is_released_when_its_dependency_succeeds() -> None:
    events: list[AnyEvent] = [registered(), submitted("j1"), submitted("j2", 2, after=["j1"])]
    state, _ = fold(events)
    b = state.jobs["j2"]
    assert b.waiting_for == "j1" and b.state == J.PENDING
    assert [t.pending_reason for t in b.tasks] == ["waiting for j1"] * 2
    assert list(state.pending) == [("j1", 0)]  # only j1 may be placed
    state, _ = fold(events + run_to("j1", 0, S.SUCCEEDED))
    b = state.jobs["j2"]
    assert b.waiting_for == "" and [t.pending_reason for t in b.tasks] == ["", ""]
    assert list(state.pending) == [("j2", 0), ("j2", 1)]


@pytest.mark.parametrize(("end", "how"), [(S.FAILED, "failed"), (S.KILLED, "killed")])
def test_an_after_dependency_ending_badly_kills_the_job_with_reason_dependency(
        end: TaskState, how: str) -> None:
    events: list[AnyEvent] = [registered(), submitted("j1"), submitted("j2", after=["j1"]),
                              submitted("j3", after=["j2"]), *run_to("j1", 0, end)]
    state, _ = fold(events)
    for job_id, dep in (("j2", "j1"), ("j3", "j2")):  # down the whole chain, no recursion
        job = state.jobs[job_id]
        assert job.state == J.KILLED and job.failure_reason == task_rules.DEPENDENCY
        assert job.error == f"dependency {dep} is {'killed' if dep == 'j2' else how}"
    assert not state.pending


def test_submitting_after_a_job_that_already_failed_kills_at_once() -> None:
    state, _ = fold([registered(), submitted("j1"), *run_to("j1", 0, S.FAILED),
                     submitted("j2", after=["j1"])])
    assert state.jobs["j2"].state == J.KILLED
    assert state.jobs["j2"].failure_reason == task_rules.DEPENDENCY


def test_after_any_starts_when_all_ended_whatever_their_state() -> None:
    events: list[AnyEvent] = [registered(), submitted("j1"), submitted("j2"),
                              submitted("j3", after_any=["j1", "j2"]), *run_to("j1", 0, S.FAILED)]
    state, _ = fold(events)
    assert state.jobs["j3"].tasks[0].pending_reason == "waiting for j2"
    assert ("j3", 0) not in state.pending
    state, _ = fold([*events, cancel("j2")])
    assert state.jobs["j3"].state == J.PENDING and state.jobs["j3"].failure_reason == ""
    assert ("j3", 0) in state.pending


def test_cancelling_a_waiting_job_kills_its_tasks_and_needs_no_kill() -> None:
    state, effects = fold([registered(), submitted("j1"), submitted("j2", after=["j1"]),
                           cancel("j2")])
    assert state.jobs["j2"].state == J.KILLED and state.jobs["j2"].failure_reason == ""
    assert not [e for e in effects if isinstance(e, Kill)]


def test_a_waiting_job_survives_a_snapshot_and_is_released_after_it() -> None:
    """A new leader (or a restarted projection) knows from the log alone what still waits."""
    a, b = "j1-abcd", "j2-abcd"  # ids as berth makes them: the snapshot checks the spec
    state, _ = fold([registered(), submitted(a), submitted(b, after=[a])])
    restored = load(dump(state, "s"), "s", state.last_seq)
    assert restored.jobs[b].waiting_for == a and (b, 0) not in restored.pending
    for seq, event in enumerate(run_to(a, 0, S.SUCCEEDED), start=state.last_seq + 1):
        restored.apply(seq, event)
    assert (b, 0) in restored.pending


def test_master_done_succeeds_on_task_0_and_kills_the_others() -> None:
    events: list[AnyEvent] = [registered(), submitted("j1", 3,
                                                      stop_criteria=StopCriteria.MASTER_DONE)]
    events += [assigned(0, index=i) for i in range(3)]
    events += [report(0, S.RUNNING, index=i) for i in range(3)]
    events += [report(0, S.SUCCEEDED, 0, index=0)]
    state, effects = fold(events)
    job = state.jobs["j1"]
    assert job.state == J.SUCCEEDED and job.error == ""
    assert [t.state for t in job.tasks] == [S.SUCCEEDED, S.KILLED, S.KILLED]
    assert sorted(e.task_index for e in effects if isinstance(e, Kill)) == [1, 2]


def test_master_done_job_still_fails_when_task_0_fails() -> None:
    state, _ = fold([registered(), submitted("j1", 2, stop_criteria=StopCriteria.MASTER_DONE),
                     *run_to("j1", 0, S.SUCCEEDED, index=1), *run_to("j1", 0, S.FAILED)])
    assert state.jobs["j1"].state == J.FAILED


def test_a_master_done_job_releases_its_after_dependents() -> None:
    state, _ = fold([registered(), submitted("j1", 2, stop_criteria=StopCriteria.MASTER_DONE),
                     submitted("j2", after=["j1"]), assigned(0, index=1),
                     *run_to("j1", 0, S.SUCCEEDED)])
    assert state.jobs["j1"].state == J.SUCCEEDED and ("j2", 0) in state.pending


A, B, C = "j1-aaaa", "j2-bbbb", "j3-cccc"


@st.composite
def dependency_sequences(draw: st.DrawFn) -> list[AnyEvent]:
    """A (master-done or not), B after A, C after_any A and B; then random reports,
    assignments and cancels, including ones no scheduler would send for a waiting job."""
    criteria = draw(st.sampled_from(list(StopCriteria)))
    events: list[AnyEvent] = [registered(), submitted(A, 2, stop_criteria=criteria,
                                                      max_retries_failure=1),
                              submitted(B, after=[A]), submitted(C, after_any=[A, B])]
    for _ in range(draw(st.integers(0, 30))):
        job = draw(st.sampled_from([A, A, A, B, C]))
        index = draw(st.integers(0, 1)) if job == A else 0
        attempt = draw(st.integers(0, 2))
        kind = draw(st.sampled_from(["assign", "report", "report", "cancel"]))
        if kind == "assign":
            events.append(assigned(attempt, index, job=job))
        elif kind == "report":
            events.append(report(attempt, draw(st.sampled_from(REPORTABLE)),
                                 draw(st.sampled_from([0, 1])), index, job=job))
        else:
            events.append(cancel(job))
    return events


@settings(max_examples=150, deadline=None)
@given(dependency_sequences())
def test_dependency_invariants(events: list[AnyEvent]) -> None:
    state = ClusterState()
    for seq, event in enumerate(events, start=1):
        state.apply(seq, event)
        if seq < 4:
            continue  # not all submitted yet
        a, b, c = (state.jobs[j] for j in (A, B, C))
        # Nothing is offered for placement before its dependencies allow it.
        if any(t.state in ATTEMPT_LIVE for t in b.tasks):
            assert a.state == J.SUCCEEDED
        if any(t.state in ATTEMPT_LIVE for t in c.tasks):
            assert a.state in JOB_TERMINAL and b.state in JOB_TERMINAL
        if any(t.key in state.pending for t in b.tasks):
            assert a.state == J.SUCCEEDED
        if any(t.key in state.pending for t in c.tasks):
            assert a.state in JOB_TERMINAL and b.state in JOB_TERMINAL
        # An `after` dependency that ended badly ends its dependent, and says so.
        if a.state in JOB_TERMINAL and a.state != J.SUCCEEDED and b.failure_reason == "":
            assert b.error.startswith("cancelled"), b.error
        if b.failure_reason:
            assert b.state == J.KILLED and a.state in JOB_TERMINAL - {J.SUCCEEDED}
        assert c.failure_reason == ""  # after_any never fails a job
        for job in (b, c):
            outcome, _ = task_rules.dependency_outcome(
                {j: state.jobs[j].state for j in job.spec.after},
                {j: state.jobs[j].state for j in job.spec.after_any})
            if job.waiting_for:  # says what it waits for exactly while it waits
                assert outcome == D.WAIT and job.state == J.PENDING
                assert not any(t.key in state.pending for t in job.tasks)
            elif job.state not in JOB_TERMINAL:
                assert outcome == D.READY
        if a.spec.stop_criteria == StopCriteria.MASTER_DONE and a.state == J.SUCCEEDED:
            assert a.tasks[0].state == S.SUCCEEDED
            assert all(t.state in (S.SUCCEEDED, S.KILLED) for t in a.tasks)


def test_an_assignment_to_a_waiting_task_is_void_and_its_process_killed() -> None:
    """No leader sends one (the release precedes any assignment in the log); if one were
    folded, the task still does not start early."""
    state, effects = fold([registered(), submitted("j1"), submitted("j2", after=["j1"]),
                           assigned(0, job="j2")])
    task = state.jobs["j2"].tasks[0]
    assert task.state == S.PENDING and task.pending_reason == "waiting for j1"
    assert [e.job_id for e in effects if isinstance(e, Kill)] == ["j2"]


@pytest.mark.parametrize(("spec", "said"), [
    ({}, ""),
    ({"after": ["j1-aaaa", "j2-bbbb"]}, "j1-aaaa, j2-bbbb to succeed"),
    ({"after": ["j1-aaaa"], "after_any": ["j3-cccc"]}, "j1-aaaa to succeed and j3-cccc to end"),
])
def test_berth_submit_says_what_a_job_waits_for(spec: dict[str, object], said: str) -> None:
    assert _waits_for(json.dumps({"name": "x", "command": ["x"], **spec}).encode()) == said


@pytest.mark.parametrize(("fields", "said"), [
    ({"after": ["nope"]}, "at `$.after[0]`"),
    ({"after_any": "j1-abcd"}, "Expected `array`, got `str` - at `$.after_any`"),
    ({"after": ["j1-abcd", "j1-abcd"]}, "after: job ids must be unique"),
    ({"stop_criteria": "first-done"}, "Invalid enum value 'first-done' - at `$.stop_criteria`"),
])
def test_bad_dependency_fields_are_one_line_naming_the_field(fields: dict[str, object],
                                                             said: str) -> None:
    payload = json.dumps({"name": "x", "command": ["x"], **fields}).encode()
    outcome = intake(payload, 7, 0, 1 << 20)
    assert isinstance(outcome, SubmitRejected), outcome
    assert said in outcome.reason and "\n" not in outcome.reason, outcome.reason
