"""`berth up`'s restart decision (berth/restarts.py) and `berth health`'s verdicts
(berth/health.py): pure functions, table tests."""

from __future__ import annotations

import pytest

from berth import health
from berth.restarts import ChildHistory, RestartPolicy, after_exit, restarted

POLICY = RestartPolicy(first_delay=0.5, factor=2.0, max_delay=30.0, stable_after=60.0)


@pytest.mark.parametrize(("started_at", "quick_exits", "exited_at", "jitter", "delay",
                          "streak"), [
    # First exit, soon after start: the first step, d/2 .. d.
    (0.0, 0, 1.0, 0.0, 0.25, 1),
    (0.0, 0, 1.0, 1.0, 0.5, 1),
    # A crash loop doubles the step each time...
    (0.0, 1, 1.0, 1.0, 1.0, 2),
    (0.0, 3, 1.0, 1.0, 4.0, 4),
    # ... up to the cap, never beyond, however long it goes on (no float overflow either).
    (0.0, 6, 1.0, 1.0, 30.0, 7),
    (0.0, 5000, 1.0, 0.5, 22.5, 5001),
    # Up at least stable_after: it had recovered, the backoff starts afresh.
    (0.0, 9, 60.0, 1.0, 0.5, 1),
    (100.0, 9, 200.0, 0.0, 0.25, 1),
    # Just short of it: still a crash loop.
    (0.0, 2, 59.9, 1.0, 2.0, 3),
    # Jitter out of [0, 1] is clamped: never a zero delay, never beyond the step.
    (0.0, 0, 1.0, -3.0, 0.25, 1),
    (0.0, 0, 1.0, 7.0, 0.5, 1),
])
def test_restart_delay(started_at: float, quick_exits: int, exited_at: float, jitter: float,
                       delay: float, streak: int) -> None:
    history = ChildHistory(started_at=started_at, restarts=4, quick_exits=quick_exits)
    after, waited = after_exit(POLICY, history, exited_at, jitter)
    assert waited == pytest.approx(delay)
    assert after.quick_exits == streak
    assert after.restarts == 4  # counted when it is started again, not when it exits


def test_a_crash_loop_is_never_a_busy_loop() -> None:
    history, now, waits = ChildHistory(started_at=0.0), 0.0, []
    for _ in range(50):  # exits at once, every time
        history, delay = after_exit(POLICY, history, now, 0.0)
        now += delay
        history = restarted(history, now)
        waits.append(delay)
    assert min(waits) >= POLICY.first_delay / 2
    assert max(waits) == POLICY.max_delay / 2
    assert waits == sorted(waits)
    assert history.restarts == 50


@pytest.mark.parametrize(("lease", "ttl_ms", "ok", "detail"), [
    ("sched-a:7", 2400, True, "sched-a leads, epoch 7"),
    ("host:1234:abc:12", 100, True, "host:1234:abc leads, epoch 12"),
    (None, -2, False, "no scheduler holds the leader lease"),
    ("sched-a:7", -2, False, "no scheduler holds the leader lease"),
])
def test_scheduler_verdict(lease: str | None, ttl_ms: int, ok: bool, detail: str) -> None:
    verdict = health.scheduler(lease, ttl_ms)
    assert verdict.ok is ok and detail in verdict.detail


@pytest.mark.parametrize(("status", "body", "ok", "detail"), [
    (200, {"caught_up": True, "events_seq": 9}, True, "caught up (event 9)"),
    (503, {"caught_up": False, "events_seq": 3}, False, "catching up"),
    (None, None, False, "no answer"),
    (500, "oops", False, "no answer"),
])
def test_dashboard_verdict(status: int | None, body: object, ok: bool, detail: str) -> None:
    verdict = health.dashboard(status, body)
    assert verdict.ok is ok and detail in verdict.detail


def test_worker_verdicts() -> None:
    listed = [{"worker_id": "a", "healthy": True, "last_heartbeat": 99.5},
              {"worker_id": "b", "healthy": False, "last_heartbeat": 80.0},
              {"worker_id": "c", "healthy": False, "last_heartbeat": None}]
    lines = [v.line() for v in health.workers(listed, now=100.0)]
    assert lines[0].split() == ["worker", "a", "ok", "last", "heartbeat", "0.5s", "ago"]
    assert "FAIL" in lines[1] and "not heartbeating (last heartbeat 20.0s ago)" in lines[1]
    assert "FAIL" in lines[2] and "no heartbeat yet" in lines[2]
    assert [v.ok for v in health.workers([], 0.0)] == [False]


def test_children_verdict_names_the_restarted() -> None:
    info = {"pid": 5, "children": {"local-0": {"pid": 9, "restarts": 2},
                                   "scheduler": {"pid": 8, "restarts": 0}}}
    verdict = health.children(info)
    assert verdict is not None and verdict.ok
    assert verdict.detail == "2 processes (pid 5); restarts: local-0 2"
    assert health.children({}) is None
