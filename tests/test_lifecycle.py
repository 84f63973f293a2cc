"""The event fold: scenarios, and properties over random event sequences."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.shared import task_rules
from berth.shared.lifecycle import ClusterState, Kill, Release
from berth.shared.messages import (
    AnyEvent,
    AttemptReported,
    AttemptsReported,
    Coscheduling,
    DeviceHealthChanged,
    JobCancelRequested,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    NodeAction,
    NodeHealthChanged,
    PendingReason,
    PendingReasonsChanged,
    PreemptionReleased,
    Resources,
    TaskAssigned,
    TasksAssigned,
    TasksPreempted,
    TaskUnschedulable,
    WorkerDeclaredDead,
    WorkerRegistered,
)
from berth.shared.states import JOB_TERMINAL, JobState, TaskState

S = TaskState


def submitted(job_id: str = "j1", replicas: int = 1, **spec: object) -> JobSubmitted:
    return JobSubmitted(job_id=job_id, submit_seq=int(job_id[1:].split("-")[0]), spec=JobSpec(
        name="t", command=["x"], replicas=replicas, resources=Resources(cpu=1, memory_mb=100),
        **spec))  # type: ignore[arg-type]


def registered(worker: str = "w1", incarnation: str = "i1") -> WorkerRegistered:
    return WorkerRegistered(worker_id=worker, incarnation=incarnation, attributes={"rack": "r1"},
                            resources=Resources(cpu=4, memory_mb=1000))


def assigned(attempt: int, index: int = 0, worker: str = "w1", epoch: int = 1,
             incarnation: str = "i1", job: str = "j1") -> TaskAssigned:
    return TaskAssigned(job_id=job, task_index=index, attempt_id=attempt, worker_id=worker,
                        incarnation=incarnation, epoch=epoch)


def report(attempt: int, state: TaskState, code: int | None = None, index: int = 0,
           worker: str = "w1", job: str = "j1", error: str = "",
           timed_out: bool = False, waiting: str = "") -> AttemptReported:
    return AttemptReported(job_id=job, task_index=index, error=error, attempt_id=attempt,
                           worker_id=worker, state=state, exit_code=code, timed_out=timed_out,
                           waiting=waiting)


def fold(events: list[AnyEvent]) -> tuple[ClusterState, list[object]]:
    state = ClusterState()
    effects: list[object] = []
    for seq, event in enumerate(events, start=1):
        effects += state.apply(seq, event)
    return state, effects


def test_fails_twice_then_succeeds_under_max_retries_failure_2() -> None:
    events: list[AnyEvent] = [registered(), submitted(max_retries_failure=2)]
    for attempt in (0, 1):
        events += [assigned(attempt), report(attempt, S.RUNNING), report(attempt, S.FAILED, 1)]
    events += [assigned(2), report(2, S.RUNNING), report(2, S.SUCCEEDED, 0)]
    state, effects = fold(events)
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.SUCCEEDED and task.failure_count == 2
    assert [a.state for a in task.attempts] == [S.FAILED, S.FAILED, S.SUCCEEDED]
    assert state.jobs["j1"].state == JobState.SUCCEEDED
    assert [e for e in effects if isinstance(e, Release)] == [
        Release("w1", f"j1/0/{i}") for i in range(3)]
    assert state.workers["w1"].used.cpu == 0
    assert state.job_by_submit == {1: "j1"}


def test_a_reader_that_asks_is_told_each_job_that_ends_once() -> None:
    state = ClusterState()
    state.finished_jobs = []
    events = [registered(), submitted(), submitted("j2-aaaa", replicas=2), assigned(0),
              report(0, S.RUNNING), report(0, S.SUCCEEDED, 0), cancel("j2-aaaa"),
              report(0, S.SUCCEEDED, 0)]
    told = []
    for seq, event in enumerate(events, start=1):
        state.apply(seq, event)
        told.append(list(state.finished_jobs))
        state.finished_jobs.clear()
    assert told == [[], [], [], [], [], ["j1"], ["j2-aaaa"], []]
    assert ClusterState().finished_jobs is None  # not kept unless asked for


def test_stale_attempt_report_is_refused_but_its_exit_still_frees_resources() -> None:
    state, _ = fold([registered(), submitted(max_retries_preemption=5),
                     assigned(0), report(0, S.RUNNING),
                     WorkerDeclaredDead(worker_id="w1", incarnation="i1"),
                     registered(incarnation="i2"), assigned(1, incarnation="i2"),
                     report(0, S.RUNNING)])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.ASSIGNED and task.preemption_count == 1
    assert task.attempts[0].worker_failure
    assert task.refused_reports == ()  # attempt 0 already exited: the late report is moot


def test_report_about_an_older_live_attempt_is_refused_visibly() -> None:
    # Attempt 0's assignment lands after attempt 1's (a deposed leader): it is stale.
    state, effects = fold([registered(), submitted(), assigned(1), assigned(0),
                           report(0, S.RUNNING)])
    task = state.jobs["j1"].tasks[0]
    assert [a.attempt_id for a in task.attempts] == [0, 1]
    assert task.current_attempt is not None and task.current_attempt.attempt_id == 1
    assert task.refused_reports == ("Stale attempt: attempt 0 != current 1",)
    assert Kill("w1", "i1", "j1", 0, 0, "task is assigned") in effects
    assert task.state == S.ASSIGNED


def test_worker_pending_report_never_regresses_assigned() -> None:
    state, _ = fold([registered(), submitted(), assigned(0), report(0, S.PENDING)])
    assert state.jobs["j1"].tasks[0].state == S.ASSIGNED


def test_job_failure_kills_surviving_tasks_and_keeps_their_resources_until_exit() -> None:
    state, effects = fold([registered(), submitted(replicas=2), assigned(0, 0), assigned(0, 1),
                           report(0, S.RUNNING, index=1), report(0, S.FAILED, 2, index=0)])
    job = state.jobs["j1"]
    assert job.state == JobState.FAILED
    assert job.tasks[1].state == S.KILLED
    assert Kill("w1", "i1", "j1", 1, 0, "job failed") in effects
    assert state.workers["w1"].used.cpu == 1000  # not released on the kill itself
    state.apply(0, report(0, S.KILLED, -15, index=1))
    assert state.workers["w1"].used.cpu == 0


def test_a_deposed_leaders_death_verdict_is_void() -> None:
    state, _ = fold([registered(), submitted(), LeaderElected(scheduler_id="b", epoch=2),
                     assigned(0, epoch=2),
                     WorkerDeclaredDead(worker_id="w1", incarnation="i1", epoch=1)])
    assert state.workers["w1"].alive and state.jobs["j1"].tasks[0].state == S.ASSIGNED
    state.apply(0, WorkerDeclaredDead(worker_id="w1", incarnation="i1", epoch=2))
    assert not state.workers["w1"].alive
    assert state.jobs["j1"].tasks[0].state == S.PENDING  # preempted, retried


def test_an_assignment_and_its_workers_death_fold_the_same_in_either_order() -> None:
    dead = WorkerDeclaredDead(worker_id="w1", incarnation="i1")
    base: list[AnyEvent] = [registered(), submitted(max_retries_preemption=3)]
    one, effects = fold([*base, assigned(0), dead])
    other, other_effects = fold([*base, dead, assigned(0)])
    for state in (one, other):
        task = state.jobs["j1"].tasks[0]
        assert (task.state, task.preemption_count) == (S.PENDING, 1)
        assert task.attempts[0].state == S.WORKER_FAILED and task.attempts[0].exited
        assert state.workers["w1"].used.cpu == 0 and state.workers["w1"].live_attempts == {}
    assert Release("w1", "j1/0/0") in effects and Release("w1", "j1/0/0") in other_effects


def test_void_assignment_of_a_deposed_leader() -> None:
    state, _ = fold([registered(), submitted(), LeaderElected(scheduler_id="b", epoch=2),
                     assigned(0, epoch=1)])
    assert state.jobs["j1"].tasks[0].state == S.PENDING
    assert state.workers["w1"].used.cpu == 0


def cancel(job: str = "j1", seq: int = 50, reason: str = "", user: str = ""
           ) -> JobCancelRequested:
    return JobCancelRequested(job_id=job, submit_seq=seq, reason=reason, user=user)


def unschedulable(index: int = 0, job: str = "j1", epoch: int = 1) -> TaskUnschedulable:
    return TaskUnschedulable(job_id=job, task_index=index, epoch=epoch,
                             reason="scheduling timeout of 5s expired: no live workers")


def test_cancel_kills_unfinished_tasks_and_only_running_ones_need_a_kill() -> None:
    state, effects = fold([registered(), submitted(replicas=3), assigned(0, 0),
                           report(0, S.RUNNING, index=0), assigned(0, 1),
                           report(0, S.RUNNING, index=1), report(0, S.SUCCEEDED, 0, index=1),
                           cancel(reason="wrong data", user="ada")])
    job = state.jobs["j1"]
    assert [t.state for t in job.tasks] == [S.KILLED, S.SUCCEEDED, S.KILLED]
    assert job.state == JobState.KILLED and job.error == "cancelled by ada: wrong data"
    assert [e for e in effects if isinstance(e, Kill)] == [
        Kill("w1", "i1", "j1", 0, 0, "cancelled by ada: wrong data")]
    assert state.pending == {}  # the pending task 2 is simply killed
    assert state.cancel_by_submit == {50: "j1"}
    # The worker confirms: the attempt ends KILLED and its resources are released.
    effects = state.apply(0, report(0, S.KILLED, -15, index=0))
    assert Release("w1", "j1/0/0") in effects
    assert job.tasks[0].attempts[0].state == S.KILLED and job.tasks[0].error.startswith("cancel")
    # A cancel of a finished job changes nothing.
    assert state.apply(0, cancel()) == [] and job.error == "cancelled by ada: wrong data"


def test_killed_before_it_started_is_confirmed_from_assigned() -> None:
    state, effects = fold([registered(), submitted(), assigned(0), cancel(),
                           report(0, S.KILLED, error="killed before it started: cancelled")])
    attempt = state.jobs["j1"].tasks[0].attempts[0]
    assert attempt.state == S.KILLED and attempt.exited and attempt.started_at is None
    assert Release("w1", "j1/0/0") in effects
    assert state.workers["w1"].used.cpu == 0


def test_a_parent_ending_badly_cancels_descendants_but_success_does_not() -> None:
    family = [registered(), submitted("j1"), submitted("j2", parent="j1"),
              submitted("j3", parent="j2"), submitted("j4", parent="j1")]
    state, _ = fold([*family, assigned(0, job="j1"), report(0, S.RUNNING, job="j1"),
                     report(0, S.FAILED, 1, job="j1")])
    assert state.jobs["j1"].state == JobState.FAILED
    assert state.jobs["j1"].children == ("j2", "j4")
    assert state.jobs["j2"].error == "parent job j1 failed"
    assert state.jobs["j3"].error == "parent job j2 killed"
    assert all(state.jobs[j].state == JobState.KILLED for j in ("j2", "j3", "j4"))
    # Submitted after its parent ended badly: cancelled at birth.
    state.apply(0, submitted("j5", parent="j1"))
    assert state.jobs["j5"].state == JobState.KILLED
    assert state.jobs["j5"].error == "parent job j1 is failed"

    state, _ = fold([*family, assigned(0, job="j1"), report(0, S.RUNNING, job="j1"),
                     report(0, S.SUCCEEDED, 0, job="j1")])
    assert state.jobs["j1"].state == JobState.SUCCEEDED
    assert all(state.jobs[j].state == JobState.PENDING for j in ("j2", "j3", "j4"))


def test_a_long_chain_of_children_is_cancelled_without_recursion() -> None:
    chain: list[AnyEvent] = [submitted("j1")]
    chain += [submitted(f"j{i}", parent=f"j{i - 1}") for i in range(2, 3001)]
    state, _ = fold([*chain, cancel("j1")])
    assert state.jobs["j3000"].state == JobState.KILLED
    assert state.jobs["j3000"].error == "parent job j2999 killed"


def test_scheduling_timeout_makes_the_job_unschedulable_and_kills_the_rest() -> None:
    state, effects = fold([registered(), submitted(replicas=2), assigned(0, 0),
                           report(0, S.RUNNING, index=0), unschedulable(1)])
    job = state.jobs["j1"]
    assert [t.state for t in job.tasks] == [S.KILLED, S.UNSCHEDULABLE]
    assert job.state == JobState.UNSCHEDULABLE
    assert job.error == "job unschedulable: task 1: scheduling timeout of 5s expired: " \
                        "no live workers"
    assert Kill("w1", "i1", "j1", 0, 0, "job unschedulable") in effects
    # Too late for a task that was placed meanwhile, or from a deposed leader: no effect.
    state, _ = fold([registered(), submitted(), assigned(0), unschedulable(0)])
    assert state.jobs["j1"].tasks[0].state == S.ASSIGNED
    state, _ = fold([registered(), submitted(), LeaderElected(scheduler_id="b", epoch=3),
                     unschedulable(0, epoch=2)])
    assert state.jobs["j1"].tasks[0].state == S.PENDING


def test_pending_reasons_land_on_pending_tasks_only_and_clear_on_placement() -> None:
    why = PendingReasonsChanged(epoch=1, reasons=[
        PendingReason("j1", 0, "insufficient memory: need 16384 MiB"),
        PendingReason("j1", 1, "no live workers")])
    state, _ = fold([registered(), submitted(replicas=2), assigned(0, 1), why])
    tasks = state.jobs["j1"].tasks
    assert tasks[0].pending_reason == "insufficient memory: need 16384 MiB"
    assert tasks[1].pending_reason == ""  # assigned already
    state.apply(0, assigned(0, 0))
    assert tasks[0].pending_reason == ""


def test_what_an_assigned_attempt_waits_for_on_its_worker_shows_until_it_builds() -> None:
    slot = "waiting for a build slot: 4 builds at once on this worker (BERTH_MAX_BUILDS)"
    state, _ = fold([registered(), submitted(replicas=2, max_retries_failure=1),
                     assigned(0, 0), assigned(0, 1), report(0, S.ASSIGNED, waiting=slot),
                     report(0, S.ASSIGNED, index=1, waiting=slot)])
    tasks = state.jobs["j1"].tasks
    assert [t.state for t in tasks] == [S.ASSIGNED, S.ASSIGNED]  # not a transition
    assert [t.pending_reason for t in tasks] == [slot, slot]
    assert not tasks[0].refused_reports
    state.apply(0, report(0, S.BUILDING))
    state.apply(0, report(0, S.FAILED, 1, index=1))  # retried: pending, for placement to say
    assert [t.state for t in tasks] == [S.BUILDING, S.PENDING]
    assert [t.pending_reason for t in tasks] == ["", ""]
    state.apply(0, report(0, S.ASSIGNED, waiting=slot))  # late: the task has moved on
    assert tasks[0].pending_reason == ""


def test_runtime_timeout_reported_killed_ends_the_job_with_the_reason() -> None:
    why = "timed out: ran longer than the task timeout of 1s"
    state, effects = fold([registered(), submitted(replicas=2), assigned(0, 0), assigned(0, 1),
                           report(0, S.RUNNING, index=0), report(0, S.RUNNING, index=1),
                           report(0, S.KILLED, -15, index=0, error=why)])
    job = state.jobs["j1"]
    assert job.tasks[0].state == S.KILLED and job.tasks[0].error == why
    assert job.state == JobState.KILLED and job.error == f"job killed: task 0: {why}"
    assert job.tasks[1].state == S.KILLED
    assert Kill("w1", "i1", "j1", 1, 0, "job killed") in effects


def test_reports_follow_the_diagram_and_a_regression_is_refused_visibly() -> None:
    # A process quicker than its reports: ASSIGNED -> SUCCEEDED walks the diagram's steps.
    state, _ = fold([registered(), submitted(), assigned(0), report(0, S.SUCCEEDED, 0)])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.SUCCEEDED and task.attempts[0].started_at is not None
    state, _ = fold([registered(), submitted(), assigned(0), report(0, S.RUNNING),
                     report(0, S.BUILDING)])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.RUNNING
    assert task.refused_reports == ("Invalid transition: running -> building (attempt 0)",)


def rack_worker(worker: str, rack: str = "r1") -> WorkerRegistered:
    return WorkerRegistered(worker_id=worker, incarnation="i1", attributes={"rack": rack},
                            resources=Resources(cpu=4, memory_mb=1000))


def gang_assigned(attempt: int, index: int, worker: str) -> TaskAssigned:
    return TaskAssigned(job_id="j1", task_index=index, attempt_id=attempt, worker_id=worker,
                        incarnation="i1", epoch=1, group="rack=r1", ports={"coord": 30000},
                        coordinator="w0:30000")


def gang_job(**spec: object) -> list[AnyEvent]:
    return [rack_worker("w0"), rack_worker("w1"), rack_worker("w2"),
            submitted(replicas=2, coscheduling=Coscheduling(group_by="rack"), **spec),
            gang_assigned(0, 0, "w0"), gang_assigned(0, 1, "w1"),
            report(0, S.RUNNING, index=0, worker="w0"), report(0, S.RUNNING, index=1, worker="w1")]


def test_a_gang_holds_its_whole_group_until_every_attempt_exits() -> None:
    state, _ = fold(gang_job())
    assert state.groups["rack=r1"].members == ["w0", "w1", "w2"]
    assert {w.worker_id: w.holder for w in state.workers.values()} == {
        "w0": "j1", "w1": "j1", "w2": "j1"}  # w2 too: the group is held, not just hosts
    assert state.workers["w0"].ports_used == {30000: "j1/0/0"}
    state.apply(0, report(0, S.SUCCEEDED, 0, index=0, worker="w0"))
    assert state.workers["w2"].holder == "j1"
    state.apply(0, report(0, S.SUCCEEDED, 0, index=1, worker="w1"))
    assert state.groups == {} and all(w.holder is None for w in state.workers.values())
    assert state.workers["w0"].ports_used == {}


def test_a_gang_task_failing_terminally_takes_its_siblings_down_for_good() -> None:
    state, effects = fold([*gang_job(), report(0, S.FAILED, 1, index=0, worker="w0")])
    job = state.jobs["j1"]
    sibling = job.tasks[1]
    assert sibling.state == S.WORKER_FAILED and sibling.error == "gang member 0 failed: exit code 1"
    # Finished (the seed exhausts its budget), but its counter counts its own attempts.
    assert sibling.preemption_count == 1 and sibling.stopped_with_gang
    assert job.state == JobState.FAILED
    assert Kill("w1", "i1", "j1", 1, 0, "gang member 0 failed: exit code 1") in effects
    assert state.groups  # w1's attempt has not confirmed its exit: the group is still held
    state.apply(0, report(0, S.KILLED, -15, index=1, worker="w1"))
    assert state.groups == {}


def test_gang_members_count_their_own_attempts_and_say_which_member_failed() -> None:
    """Issue 21: a member stopped because another failed for good read preemption_count
    101 after two attempts, and said only "gang sibling task 0 failed"."""
    state, _ = fold([*gang_job(max_retries_failure=1),
                     report(0, S.FAILED, 1, index=0, worker="w0", error="exit code 1"),
                     report(0, S.KILLED, -15, index=1, worker="w1"),
                     gang_assigned(1, 0, "w0"), gang_assigned(1, 1, "w1"),
                     report(1, S.RUNNING, index=0, worker="w0"),
                     report(1, S.RUNNING, index=1, worker="w1"),
                     report(1, S.FAILED, 2, index=0, worker="w0", error="exit code 2")])
    job = state.jobs["j1"]
    member = job.tasks[1]
    assert len(member.attempts) == 2
    assert (member.state, member.preemption_count, member.failure_count) == (
        S.WORKER_FAILED, 2, 0)
    assert member.error == "gang member 0 failed: exit code 2"
    assert job.tasks[0].failure_count == 2 and job.state == JobState.FAILED
    assert ("j1", 1) not in state.pending


def test_a_retried_gang_task_requeues_the_whole_gang() -> None:
    state, effects = fold([*gang_job(max_retries_failure=1),
                           report(0, S.FAILED, 1, index=0, worker="w0")])
    job = state.jobs["j1"]
    assert [t.state for t in job.tasks] == [S.PENDING, S.PENDING]
    assert job.tasks[1].preemption_count == 1 and job.tasks[0].failure_count == 1
    assert Kill("w1", "i1", "j1", 1, 0, "gang member 0 is retried: exit code 1") in effects
    # The killed sibling confirms its exit: the task stays PENDING, waiting for the gang.
    state.apply(0, report(0, S.KILLED, -15, index=1, worker="w1"))
    assert [t.state for t in job.tasks] == [S.PENDING, S.PENDING]
    assert set(state.pending) == {("j1", 0), ("j1", 1)}
    assert job.tasks[1].attempts[0].state == S.KILLED and state.groups == {}


def test_a_dead_worker_in_a_gang_retries_the_whole_gang() -> None:
    state, effects = fold([*gang_job(), WorkerDeclaredDead(worker_id="w0", incarnation="i1")])
    job = state.jobs["j1"]
    assert [t.state for t in job.tasks] == [S.PENDING, S.PENDING]
    assert [t.preemption_count for t in job.tasks] == [1, 1]
    assert Kill("w1", "i1", "j1", 1, 0, "gang member 0 is retried: worker dead") in effects


# --- properties over random event sequences ------------------------------------------------

REPORTABLE = [S.PENDING, S.ASSIGNED, S.BUILDING, S.RUNNING, S.SUCCEEDED, S.FAILED, S.KILLED]


# Real job ids (the spec checks a parent id's shape), so snapshots can be loaded.
J1, J2 = "j1-aaaa", "j2-bbbb"


def device_of(job: str, index: int, attempt: int) -> int:
    return 100 * (job == J2) + 10 * attempt + index


def test_a_resumable_task_killed_at_its_timeout_is_retried_on_its_own_budget() -> None:
    why = "timed out: ran longer than the task timeout of 1s"
    events: list[AnyEvent] = [registered(), submitted(resumable=True, max_resumes=2)]
    for attempt in range(3):
        events += [assigned(attempt), report(attempt, S.RUNNING),
                   report(attempt, S.KILLED, -15, error=why, timed_out=True)]
    state, _ = fold(events[:5])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.PENDING and task.resume_count == 1 and task.failure_count == 0
    assert state.jobs["j1"].state == JobState.PENDING
    state, _ = fold(events)  # the third timeout is past max_resumes=2
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.KILLED and task.resume_count == 2 and task.error == why
    assert state.jobs["j1"].state == JobState.KILLED
    # Not resumable: the first timeout ends it; a resumable task's plain failure still
    # counts against max_retries_failure (0 here).
    state, _ = fold([registered(), submitted(), *events[2:5]])
    assert state.jobs["j1"].tasks[0].state == S.KILLED
    state, _ = fold([registered(), submitted(resumable=True), assigned(0),
                     report(0, S.RUNNING), report(0, S.FAILED, 1)])
    assert state.jobs["j1"].state == JobState.FAILED


@st.composite
def event_sequences(draw: st.DrawFn) -> list[AnyEvent]:
    replicas = draw(st.integers(1, 3))
    limits = dict(max_retries_failure=draw(st.integers(0, 2)),
                  max_retries_preemption=draw(st.integers(0, 2)),
                  max_task_failures=draw(st.integers(0, 1)),
                  resumable=draw(st.booleans()), max_resumes=draw(st.integers(0, 1)))
    events: list[AnyEvent] = [
        registered("w1", "i1"), registered("w2", "i1"),
        submitted(J1, replicas=replicas, **limits),
        submitted(J2, replicas=replicas, parent=J1, **limits,
                  coscheduling=draw(st.sampled_from([None, Coscheduling(group_by="rack")]))),
    ]
    incarnations = {"w1": 1, "w2": 1}
    kinds = ["assign", "report", "report", "report", "dead", "dup", "cancel", "unschedulable",
             "reasons", "device", "node", "preempt", "unhold"]
    for n in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from(kinds))
        worker = draw(st.sampled_from(["w1", "w2"]))
        job = draw(st.sampled_from([J1, J1, J2]))
        inc = f"i{incarnations[worker]}"
        index = draw(st.integers(0, replicas - 1))
        attempt = draw(st.integers(0, 4))
        if kind == "assign":
            event = assigned(attempt, index, worker, incarnation=inc, job=job)
            # One device per attempt, never another's (the reserve commit's guarantee).
            event = msgspec.structs.replace(event, devices=[device_of(job, index, attempt)])
            if job == J2:
                event = msgspec.structs.replace(event, group="rack=r1")
            events.append(event)
        elif kind == "device":
            events.append(DeviceHealthChanged(
                worker_id=worker, index=device_of(job, index, attempt),
                healthy=draw(st.booleans()), reason="3 uncorrectable ECC errors"))
        elif kind == "node":
            events.append(NodeHealthChanged(worker_id=worker,
                                            action=draw(st.sampled_from(list(NodeAction))),
                                            reason="r", deadline=0.0))
        elif kind == "report":
            state = draw(st.sampled_from(REPORTABLE))
            events.append(report(attempt, state, draw(st.sampled_from([None, 0, 1])), index,
                                 worker, job, timed_out=state == S.KILLED and draw(st.booleans()),
                                 waiting="waiting for a build slot" if state == S.ASSIGNED
                                 else ""))
        elif kind == "dead":
            events.append(WorkerDeclaredDead(worker_id=worker, incarnation=inc))
            incarnations[worker] += 1
            events.append(registered(worker, f"i{incarnations[worker]}"))
        elif kind == "cancel":
            events.append(cancel(job))
        elif kind == "unschedulable":
            events.append(unschedulable(index, job))
        elif kind == "preempt":
            # The other job preempts this attempt (and the gang's whole, as the planner
            # always asks), holding the worker.
            victims = [f"{job}/{i}/{attempt}" for i in range(replicas)] if job == J2 else [
                f"{job}/{index}/{attempt}"]
            events.append(TasksPreempted(id=f"p{n}", job_id=J2 if job == J1 else J1,
                                         victims=victims, hosts=[worker], epoch=1))
        elif kind == "unhold":
            events.append(PreemptionReleased(id=f"u{n}", job_id=job, hosts=[worker], epoch=1))
        elif kind == "reasons":
            events.append(PendingReasonsChanged(epoch=1, reasons=[
                PendingReason(job, index, draw(st.sampled_from(["no live workers", "cpu"])))]))
        else:
            events.append(events[draw(st.integers(0, len(events) - 1))])
    return events


@settings(max_examples=400, deadline=None)
@given(event_sequences())
def test_fold_invariants(events: list[AnyEvent]) -> None:
    state = ClusterState()
    finished: dict[tuple[str, int], TaskState] = {}
    ended: dict[str, JobState] = {}
    # A reader's index of `pending` kept from the changes alone (as the scheduler's pending
    # queue is), drained after some events and not others, always equals `pending`.
    state.pending_changes = {}
    kept: set[tuple[str, int]] = set()
    for seq, event in enumerate(events, start=1):
        state.apply(seq, event)
        if seq % 3:
            for key, now in state.pending_changes.items():
                (kept.add if now else kept.discard)(key)
            state.pending_changes = {}
            assert kept == state.pending.keys()
        for job in state.jobs.values():
            spec = job.spec
            for task in job.tasks:
                # A finished task never changes.
                if task.key in finished:
                    assert task.state == finished[task.key]
                done = task_rules.is_finished(
                    task.state, task.failure_count, spec.max_retries_failure,
                    task.preemption_count, spec.max_retries_preemption, task.stopped_with_gang)
                if done:
                    finished.setdefault(task.key, task.state)
                # Counters never exceed limit + 1.
                assert task.failure_count <= spec.max_retries_failure + 1
                assert task.preemption_count <= spec.max_retries_preemption + 1
                # Exactly the schedulable tasks wait for placement.
                schedulable = task_rules.can_be_scheduled(
                    task.state, task.failure_count, spec.max_retries_failure,
                    task.preemption_count, spec.max_retries_preemption, task.stopped_with_gang)
                assert (task.key in state.pending) == schedulable
                # What a worker said an attempt waits for shows only while it waits there.
                if task.pending_reason == "waiting for a build slot":
                    assert task.state == S.ASSIGNED
                # When a job has ended, none of its tasks is left unfinished.
                if job.state in JOB_TERMINAL:
                    assert done, (job.state, task)
            # The kept counts are the counts of its tasks' states.
            recount: dict[TaskState, int] = {}
            for task in job.tasks:
                recount[task.state] = recount.get(task.state, 0) + 1
            assert job.counts() == recount
            # Job state always equals the derivation of its task states.
            assert job.state == task_rules.derive_job_state(
                (t.state for t in job.tasks), spec.max_task_failures)
            # An ended job never changes.
            if job.job_id in ended:
                assert job.state == ended[job.job_id]
            elif job.state in JOB_TERMINAL:
                ended[job.job_id] = job.state
        # A parent that ended in anything but success has no unfinished child.
        parent, child = state.jobs.get(J1), state.jobs.get(J2)
        if parent and child and parent.state in JOB_TERMINAL - {JobState.SUCCEEDED}:
            assert child.state in JOB_TERMINAL
        # A group is held exactly while attempts tagged with it are live, and holds its
        # members for its gang.
        tagged: dict[str, set[str]] = {}
        for worker in state.workers.values():
            for key, (job_id, index, attempt_id) in worker.live_attempts.items():
                live = state.jobs[job_id].tasks[index].attempt(attempt_id)
                if live is not None and live.group:
                    tagged.setdefault(live.group, set()).add(key)
        assert {name: set(g.live) for name, g in state.groups.items()} == tagged
        for worker in state.workers.values():
            holders = {g.job_id for g in state.groups.values()
                       if g.exclusive and worker.worker_id in g.members}
            assert holders == ({worker.holder} if worker.holder else set())
        # A device is held exactly by the live attempt it was given to.
        for worker in state.workers.values():
            holding = {}
            for key, (job_id, index, attempt_id) in worker.live_attempts.items():
                live = state.jobs[job_id].tasks[index].attempt(attempt_id)
                assert live is not None
                holding.update({d: key for d in live.devices})
            assert worker.devices_used == holding
        # Committed resources equal the sum over live attempts, never negative.
        for worker in state.workers.values():
            assert worker.used.cpu == 1000 * len(worker.live_attempts)
            assert worker.used.cpu >= 0


@settings(max_examples=100, deadline=None)
@given(event_sequences())
def test_redelivery_changes_nothing(events: list[AnyEvent]) -> None:
    import msgspec

    once, _ = fold(events)
    twice = ClusterState()
    for seq, event in enumerate(events, start=1):
        twice.apply(seq, event)
        twice.apply(seq, event)  # at-least-once delivery: the same message again
    enc = msgspec.json.encode
    assert enc(list(once.jobs.values())) == enc(list(twice.jobs.values()))
    assert enc(list(once.workers.values())) == enc(list(twice.workers.values()))


@settings(max_examples=150, deadline=None)
@given(event_sequences(), st.data())
def test_a_snapshot_taken_anywhere_continues_to_the_same_state(
        events: list[AnyEvent], data: st.DataObject) -> None:
    """Save mid-stream, load, fold the rest (with a redelivered stretch): exactly the state
    of one fold from sequence 1, compared through a second snapshot."""
    from berth.shared import state_snapshot

    straight, _ = fold(events)
    cut = data.draw(st.integers(0, len(events)))
    first = ClusterState()
    for seq, event in enumerate(events[:cut], start=1):
        first.apply(seq, event)
    resumed = state_snapshot.load(state_snapshot.dump(first, "events@t"), "events@t", cut)
    redelivered_from = data.draw(st.integers(1, cut + 1))
    for seq, event in enumerate(events[redelivered_from - 1:], start=redelivered_from):
        resumed.apply(seq, event)
    # Compared as plain data: the test builds some float fields from ints (4 == 4.0).
    def plain(state: ClusterState) -> object:
        return msgspec.msgpack.decode(state_snapshot.dump(state, "events@t"))

    assert plain(resumed) == plain(straight)
    assert resumed.job_by_submit == straight.job_by_submit


def test_a_task_with_nothing_to_build_goes_from_assigned_straight_to_running() -> None:
    state, _ = fold([registered(), submitted(), assigned(0), report(0, S.RUNNING)])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.RUNNING and task.attempts[0].started_at is not None
    assert task.refused_reports == ()
    # Its exit (also one that comes before its RUNNING report is folded, or a RUNNING that
    # comes after it: a publish sent again past the stream's dedup window) ends it.
    for events in ([report(0, S.RUNNING), report(0, S.SUCCEEDED, 0)],
                   [report(0, S.SUCCEEDED, 0)],
                   [report(0, S.SUCCEEDED, 0), report(0, S.RUNNING)]):
        state, _ = fold([registered(), submitted(), assigned(0), *events])
        assert state.jobs["j1"].state == JobState.SUCCEEDED
        task = state.jobs["j1"].tasks[0]
        assert task.state == S.SUCCEEDED and task.attempts[0].started_at is not None
        assert task.refused_reports == ()


def batched(events: list[AnyEvent]) -> list[AnyEvent]:
    """`events` with each run of consecutive reports of one worker as one batch message."""
    out: list[AnyEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, AttemptReported) and isinstance(last, AttemptsReported) and (
                last.worker_id == event.worker_id):
            last.reports.append(event)
        elif isinstance(event, AttemptReported) and isinstance(last, AttemptReported) and (
                last.worker_id == event.worker_id):
            out[-1] = AttemptsReported(worker_id=event.worker_id, reports=[last, event])
        else:
            out.append(event)
    return out


def folded(state: ClusterState) -> bytes:
    return msgspec.json.encode([list(state.jobs.values()), list(state.workers.values())])


@settings(max_examples=60, deadline=None)
@given(event_sequences())
def test_a_batch_folds_exactly_as_its_reports_one_by_one(events: list[AnyEvent]) -> None:
    one_by_one, effects = fold(events)
    as_batches, batch_effects = fold(batched(events))
    assert folded(as_batches) == folded(one_by_one)
    assert batch_effects == effects


def assignments_batched(events: list[AnyEvent]) -> list[AnyEvent]:
    """`events` with each run of assignments of one term as one `tasks_assigned`, as a
    leader logs a tick's commit."""
    out: list[AnyEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, TaskAssigned) and isinstance(last, TasksAssigned) and (
                last.epoch == event.epoch):
            last.assignments.append(event)
        elif isinstance(event, TaskAssigned) and isinstance(last, TaskAssigned) and (
                last.epoch == event.epoch):
            out[-1] = TasksAssigned(epoch=event.epoch, assignments=[last, event])
        else:
            out.append(event)
    return out


@settings(max_examples=60, deadline=None)
@given(event_sequences())
def test_a_tick_of_assignments_folds_exactly_as_its_assignments_one_by_one(
        events: list[AnyEvent]) -> None:
    one_by_one, effects = fold(events)
    as_batches, batch_effects = fold(assignments_batched(events))
    assert folded(as_batches) == folded(one_by_one)
    assert batch_effects == effects
    assert one_by_one.attempt_keys_reused == as_batches.attempt_keys_reused


@pytest.mark.parametrize("late_first", [True, False])
def test_a_deposed_leaders_batch_is_void_and_burns_its_ids_in_either_order(
        late_first: bool) -> None:
    """Term 1's batch folded after term 2 was elected holds nothing; folded before, it is
    a committed assignment. Either way, exactly as the same assignments one by one."""
    late = [assigned(0, 0, "w1", epoch=1, job=J1), assigned(0, 1, "w2", epoch=1, job=J1)]
    start = [registered("w1"), registered("w2"), submitted(J1, replicas=2),
             LeaderElected(scheduler_id="s1", epoch=1)]
    elected = LeaderElected(scheduler_id="s2", epoch=2)
    batch = TasksAssigned(epoch=1, assignments=list(late))
    middle: list[AnyEvent] = [batch, elected] if not late_first else [elected, batch]
    one: list[AnyEvent] = [*late, elected] if not late_first else [elected, *late]
    as_batch, _ = fold(start + middle)
    one_by_one, _ = fold(start + one)
    assert folded(as_batch) == folded(one_by_one)
    tasks = as_batch.jobs[J1].tasks
    if late_first:
        assert all(not t.attempts and t.burned_attempt_id == 0 for t in tasks)
        assert as_batch.workers["w1"].live_attempts == {}
    else:
        assert [len(t.attempts) for t in tasks] == [1, 1]
    # The same chunk delivered again (past the dedup window): as its entries again.
    again, _ = fold(start + middle + [batch])
    again_one_by_one, _ = fold(start + one + late)
    assert folded(again) == folded(again_one_by_one)
    assert again.attempt_keys_reused == again_one_by_one.attempt_keys_reused == []


@settings(max_examples=40, deadline=None)
@given(event_sequences())
def test_a_report_stored_twice_is_applied_once(events: list[AnyEvent]) -> None:
    """The same report in a later message (published again after the stream's dedup window):
    a no-op for the same attempt and state, at most recorded as refused."""
    doubled: list[AnyEvent] = []
    for event in events:
        doubled += [event, event] if isinstance(event, AttemptReported) else [event]
    once, effects = fold(events)
    twice, twice_effects = fold(doubled)
    for state in (once, twice):
        for job in state.jobs.values():
            for task in job.tasks:
                task.refused_reports = ()
    assert folded(twice) == folded(once)
    assert twice_effects == effects
