"""Node health: the quarantine rule (a table and a property), and the fold's cordon, drain,
evict, quarantine and uncordon (docs/operations.md, "Node health")."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.shared import node_health
from berth.shared.lifecycle import Kill
from berth.shared.messages import (
    AnyEvent,
    NodeAction,
    NodeHealthChanged,
    WorkerDeclaredDead,
    WorkerStopped,
)
from berth.shared.node_health import Failure, QuarantinePolicy, quarantine_reason
from berth.shared.states import JobState, TaskState
from tests.test_lifecycle import assigned, fold, registered, report, submitted

S = TaskState
POLICY = QuarantinePolicy(failures=3, jobs=2, window=60.0)


def failures(*pairs: tuple[float, str]) -> list[Failure]:
    return [Failure(ts, job) for ts, job in pairs]


@pytest.mark.parametrize(("record", "policy", "expected"), [
    ([], POLICY, None),
    # Three failures of one job: that job's trouble, not the host's.
    (failures((0, "a"), (1, "a"), (2, "a")), POLICY, None),
    (failures((0, "a"), (1, "b")), POLICY, None),  # two failures: below the threshold
    (failures((0, "a"), (1, "b"), (2, "a")), POLICY,
     "3 attempts of 2 jobs failed here within 60s for non-user causes"),
    # The first failure is outside the window counted back from the newest.
    (failures((0, "a"), (61, "b"), (62, "a")), POLICY, None),
    (failures((0, "a"), (61, "b"), (62, "a"), (63, "c")), POLICY,
     "3 attempts of 3 jobs failed here within 60s for non-user causes"),
    (failures((0, "a"), (1, "b"), (2, "c")), QuarantinePolicy(failures=0), None),  # never
    (failures((0, "a")), QuarantinePolicy(failures=1, jobs=1), "1 attempts of 1 jobs failed "
     "here within 600s for non-user causes"),
])
def test_quarantine_reason(record: list[Failure], policy: QuarantinePolicy,
                           expected: str | None) -> None:
    assert quarantine_reason(record, policy) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1000), st.sampled_from("abcd")), max_size=12),
       st.integers(1, 5), st.integers(1, 4), st.floats(1, 500))
def test_quarantine_agrees_with_its_definition(pairs: list[tuple[float, str]], n: int, m: int,
                                               window: float) -> None:
    record = failures(*pairs)
    policy = QuarantinePolicy(failures=n, jobs=m, window=window)
    newest = max((f.ts for f in record), default=0.0)
    recent = [f for f in record if newest - f.ts <= window]
    expected = len(recent) >= n and len({f.job_id for f in recent}) >= m
    assert (quarantine_reason(record, policy) is not None) is expected
    # The order the failures came in does not matter.
    assert quarantine_reason(record[::-1], policy) == quarantine_reason(record, policy)


def node(action: NodeAction, worker: str = "w1", **kw: object) -> NodeHealthChanged:
    return NodeHealthChanged(worker_id=worker, action=action, **kw)  # type: ignore[arg-type]


def test_cordon_drain_quarantine_and_uncordon_survive_a_restart() -> None:
    state, _ = fold([registered(), node(NodeAction.CORDON, reason="disk swap", by="ops")])
    assert state.workers["w1"].out_of_service == "cordoned: by ops: disk swap"
    state, _ = fold([registered(), node(NodeAction.DRAIN, deadline=100.0),
                     registered(incarnation="i2")])
    w = state.workers["w1"]
    assert (w.out_of_service, w.draining, w.drain_deadline) == ("draining", True, 100.0)
    state, _ = fold([registered(), node(NodeAction.CORDON),
                     node(NodeAction.QUARANTINE, reason="3 attempts failed", epoch=1),
                     registered(incarnation="i2")])
    assert state.workers["w1"].out_of_service == "quarantined: 3 attempts failed"
    state, _ = fold([registered(), node(NodeAction.QUARANTINE, reason="x", epoch=1),
                     node(NodeAction.UNCORDON)])
    assert state.workers["w1"].out_of_service == ""


def test_a_deposed_leaders_quarantine_is_void() -> None:
    from berth.shared.messages import LeaderElected

    state, _ = fold([LeaderElected(scheduler_id="s", epoch=1),
                     LeaderElected(scheduler_id="s", epoch=2), registered(),
                     node(NodeAction.QUARANTINE, reason="x", epoch=1)])
    assert state.workers["w1"].out_of_service == ""


def test_restarts_and_worker_faults_are_the_hosts_failures_exits_stops_and_deaths_are_not(
        ) -> None:
    events: list[AnyEvent] = [registered(), submitted("j1", max_retries_failure=5),
                              submitted("j2", max_retries_failure=5)]
    events += [assigned(0, job="j1"), report(0, S.RUNNING, job="j1"),
               report(0, S.FAILED, 1, job="j1")]  # the user's exit code: not counted
    events += [assigned(1, job="j1"),
               msgspec.structs.replace(report(1, S.FAILED, job="j1", error="worker error: disk"),
                                       worker_fault=True)]
    events += [assigned(0, job="j2"), report(0, S.RUNNING, job="j2"),
               WorkerDeclaredDead(worker_id="w1", incarnation="i1")]
    state, _ = fold(events)
    # A death is a silence, which a network cut gives healthy hosts too: not counted.
    assert [(f.job_id) for f in state.workers["w1"].failures] == ["j1"]
    assert state.jobs["j2"].tasks[0].attempts[0].worker_failure
    # A restart under running work is one incident, however many attempts it takes down.
    state, _ = fold([registered(), submitted("j1", replicas=2), submitted("j2"),
                     assigned(0, 0, job="j1"), assigned(0, 1, job="j1"), assigned(0, job="j2"),
                     registered(incarnation="i2")])
    assert [f.job_id for f in state.workers["w1"].failures] == ["j1"]
    # A worker stopped by its operator fails its attempts, not itself.
    state, _ = fold([registered(), submitted("j1"), assigned(0, job="j1"),
                     WorkerStopped(worker_id="w1", incarnation="i1")])
    assert state.jobs["j1"].tasks[0].attempts[0].worker_failure
    assert state.workers["w1"].failures == []


def test_an_evicted_attempt_is_preempted_and_retried_not_counted_against_anyone() -> None:
    state, effects = fold([registered(), submitted("j1", max_retries_preemption=3),
                           assigned(0, job="j1"), report(0, S.RUNNING, job="j1"),
                           node(NodeAction.DRAIN, deadline=0.0),
                           node(NodeAction.EVICT, reason="its drain deadline passed", epoch=1)])
    task = state.jobs["j1"].tasks[0]
    assert task.state == S.PENDING and task.preemption_count == 1 and task.failure_count == 0
    assert task.attempts[0].kill_requested
    assert "worker w1 drained: its drain deadline passed" in task.error
    assert [e.reason for e in effects if isinstance(e, Kill)] == [
        "worker w1 drained: its drain deadline passed"]
    assert state.workers["w1"].failures == []
    assert state.jobs["j1"].state != JobState.FAILED


def test_berth_workers_shows_why_a_worker_is_out_of_service() -> None:
    from berth.cli_views import format_attempt as _format_attempt
    from berth.cli_views import format_worker as _format_worker

    worker = {"worker_id": "w1", "healthy": True, "running_attempts": [], "cpu_free": 2,
              "devices_free": 0, "resources": {"cpu": 2, "memory_mb": 1024,
                                               "device": {"type": "cpu"}},
              "out_of_service": "quarantined: 3 attempts of 2 jobs failed here"}
    assert _format_worker(worker)[1] == (
        "  OUT OF SERVICE: quarantined: 3 attempts of 2 jobs failed here")
    attempt = {"attempt_id": 0, "worker_id": "w1", "state": "succeeded",
               "worker_failure": False, "exit_code": 0, "error": "", "assigned_at": 1.0,
               "started_at": None, "finished_at": None,
               "usage": {"cpu_seconds": 1.25, "peak_rss_mb": 84.5, "samples": 2}}
    assert "exit code 0, cpu 1.25s, peak RSS 84.5 MiB" in _format_attempt(attempt)


def test_a_bad_drain_deadline_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from berth import node_cli

    for bad in (-1.0, float("nan")):
        assert node_cli.node_health("nats://127.0.0.1:1", "http://127.0.0.1:1", "/nonexistent",
                                    "w1", NodeAction.DRAIN, deadline=bad) == 1
        err = capsys.readouterr().err
        assert err.startswith("berth: deadline: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(("quarantined", "workers", "share", "room"), [
    (0, 1, 0.25, True),    # always room for one
    (1, 1, 0.25, False),
    (1, 3, 0.25, False),   # a 3-host partition quarantines at most one
    (1, 8, 0.25, True),
    (2, 8, 0.25, False),
    (0, 100, 0.0, True),   # 0 still allows one
    (1, 100, 0.0, False),
    (99, 100, 1.0, True),
    (100, 100, 1.0, False),
])
def test_automatic_quarantine_takes_at_most_its_share_of_the_workers(
        quarantined: int, workers: int, share: float, room: bool) -> None:
    policy = QuarantinePolicy(max_share=share)
    assert node_health.quarantine_room(quarantined, workers, policy) is room
