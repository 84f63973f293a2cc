"""The event fold: scenarios, and properties over random event sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared import task_rules
from shared.lifecycle import ClusterState, Kill, Release
from shared.messages import (
    AnyEvent,
    AttemptReported,
    JobSpec,
    JobSubmitted,
    Resources,
    TaskAssigned,
    WorkerDeclaredDead,
    WorkerRegistered,
)
from shared.states import JobState, TaskState

S = TaskState


def submitted(job_id: str = "j1", replicas: int = 1, **spec: object) -> JobSubmitted:
    return JobSubmitted(job_id=job_id, submit_seq=1, spec=JobSpec(
        name="t", command=["x"], replicas=replicas, resources=Resources(cpu=1, memory_mb=100),
        **spec))  # type: ignore[arg-type]


def registered(worker: str = "w1", incarnation: str = "i1") -> WorkerRegistered:
    return WorkerRegistered(worker_id=worker, incarnation=incarnation,
                            resources=Resources(cpu=4, memory_mb=1000))


def assigned(attempt: int, index: int = 0, worker: str = "w1", epoch: int = 1,
             incarnation: str = "i1") -> TaskAssigned:
    return TaskAssigned(job_id="j1", task_index=index, attempt_id=attempt, worker_id=worker,
                        incarnation=incarnation, epoch=epoch)


def report(attempt: int, state: TaskState, code: int | None = None, index: int = 0,
           worker: str = "w1") -> AttemptReported:
    return AttemptReported(job_id="j1", task_index=index, attempt_id=attempt, worker_id=worker,
                           state=state, exit_code=code)


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
    assert state.workers["w1"].cpu_used_milli == 0
    assert state.job_by_submit == {1: "j1"}


def test_stale_attempt_report_is_refused_but_its_exit_still_frees_resources() -> None:
    state, _ = fold([registered(), submitted(max_retries_preemption=5),
                     assigned(0), report(0, S.RUNNING),
                     WorkerDeclaredDead(worker_id="w1", incarnation="i1"),
                     registered(incarnation="i2"), assigned(1, incarnation="i2"),
                     report(0, S.RUNNING)])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.ASSIGNED and task.preemption_count == 1
    assert task.attempts[0].worker_failure
    assert task.refused_reports == []  # attempt 0 already exited: the late report is moot


def test_report_about_an_older_live_attempt_is_refused_visibly() -> None:
    # Attempt 0's assignment lands after attempt 1's (a deposed leader): it is stale.
    state, effects = fold([registered(), submitted(), assigned(1), assigned(0),
                           report(0, S.RUNNING)])
    task = state.jobs["j1"].tasks[0]
    assert [a.attempt_id for a in task.attempts] == [0, 1]
    assert task.current_attempt is not None and task.current_attempt.attempt_id == 1
    assert task.refused_reports == ["Stale attempt: attempt 0 != current 1"]
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
    assert state.workers["w1"].cpu_used_milli == 1000  # not released on the kill itself
    state.apply(0, report(0, S.KILLED, -15, index=1))
    assert state.workers["w1"].cpu_used_milli == 0


def test_void_assignment_of_a_deposed_leader() -> None:
    from shared.messages import LeaderElected

    state, _ = fold([registered(), submitted(), LeaderElected(scheduler_id="b", epoch=2),
                     assigned(0, epoch=1)])
    assert state.jobs["j1"].tasks[0].state == S.PENDING
    assert state.workers["w1"].cpu_used_milli == 0


# --- properties over random event sequences ------------------------------------------------

REPORTABLE = [S.PENDING, S.BUILDING, S.RUNNING, S.SUCCEEDED, S.FAILED, S.KILLED]


@st.composite
def event_sequences(draw: st.DrawFn) -> list[AnyEvent]:
    replicas = draw(st.integers(1, 3))
    events: list[AnyEvent] = [
        registered("w1", "i1"), registered("w2", "i1"),
        submitted(replicas=replicas, max_retries_failure=draw(st.integers(0, 2)),
                  max_retries_preemption=draw(st.integers(0, 2)),
                  max_task_failures=draw(st.integers(0, 1))),
    ]
    incarnations = {"w1": 1, "w2": 1}
    for _ in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from(["assign", "report", "report", "report", "dead", "dup"]))
        worker = draw(st.sampled_from(["w1", "w2"]))
        inc = f"i{incarnations[worker]}"
        index = draw(st.integers(0, replicas - 1))
        attempt = draw(st.integers(0, 4))
        if kind == "assign":
            events.append(assigned(attempt, index, worker, incarnation=inc))
        elif kind == "report":
            events.append(report(attempt, draw(st.sampled_from(REPORTABLE)),
                                 draw(st.sampled_from([None, 0, 1])), index, worker))
        elif kind == "dead":
            events.append(WorkerDeclaredDead(worker_id=worker, incarnation=inc))
            incarnations[worker] += 1
            events.append(registered(worker, f"i{incarnations[worker]}"))
        else:
            events.append(events[draw(st.integers(0, len(events) - 1))])
    return events


@settings(max_examples=300, deadline=None)
@given(event_sequences())
def test_fold_invariants(events: list[AnyEvent]) -> None:
    state = ClusterState()
    finished: dict[tuple[str, int], TaskState] = {}
    for seq, event in enumerate(events, start=1):
        state.apply(seq, event)
        job = state.jobs.get("j1")
        if job is None:
            continue
        spec = job.spec
        for task in job.tasks:
            # A finished task never changes.
            if task.key in finished:
                assert task.state == finished[task.key]
            if task_rules.is_finished(task.state, task.failure_count, spec.max_retries_failure,
                                      task.preemption_count, spec.max_retries_preemption):
                finished.setdefault(task.key, task.state)
            # Counters never exceed limit + 1.
            assert task.failure_count <= spec.max_retries_failure + 1
            assert task.preemption_count <= spec.max_retries_preemption + 1
        # Job state always equals the derivation of its task states (until terminal).
        derived = task_rules.derive_job_state((t.state for t in job.tasks),
                                              spec.max_task_failures)
        if derived != job.state:
            from shared.states import JOB_TERMINAL
            assert job.state in JOB_TERMINAL
        # Committed resources equal the sum over live attempts, never negative.
        for worker in state.workers.values():
            assert worker.cpu_used_milli == 1000 * len(worker.live_attempts)
            assert worker.cpu_used_milli >= 0


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
