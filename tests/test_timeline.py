"""The host timeline's logic over a real fold (services/dashboard_api/timeline.py): which
attempt held which host when, gangs that would overlap, the bounds on a large cluster, and
the cluster chart's samples. The page that draws it: tests/test_browser.py; the endpoint
over HTTP: tests/test_dashboard_api.py."""

from __future__ import annotations

from collections import deque

import msgspec

from berth.services.dashboard_api import timeline
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import AnyEvent, Coscheduling
from berth.shared.states import TaskState
from tests.test_lifecycle import assigned, fold, registered, report, submitted

S = TaskState


def at(ts: float, event: AnyEvent) -> AnyEvent:
    return msgspec.structs.replace(event, ts=ts)


def gang(job_id: str, shareable: bool = False) -> AnyEvent:
    return submitted(job_id, coscheduling=Coscheduling(group_by="rack", shareable=shareable))


def placed(ts: float, job: str) -> AnyEvent:
    """A gang's task 0 placed on w1, in w1's group."""
    return msgspec.structs.replace(assigned(0, job=job), ts=ts, group="rack=r1")


def history() -> ClusterState:
    """w1: j1's attempt 0 (100-110, failed) and its retry (120-, running) beside j2
    (105-130, succeeded), tasks of no gang sharing the host; w2: idle."""
    state, _ = fold([
        at(1, registered("w1")), at(1, registered("w2", "i2")),
        at(99, submitted("j1", max_retries_failure=1)), at(99, submitted("j2")),
        at(100, assigned(0)), at(101, report(0, S.RUNNING)), at(110, report(0, S.FAILED, 1)),
        at(105, assigned(0, job="j2")), at(130, report(0, S.SUCCEEDED, 0, job="j2")),
        at(120, assigned(1)), at(121, report(1, S.RUNNING)),
    ])
    return state


def bars(row: timeline.HostRow) -> list[tuple[str, int, float, float | None, str]]:
    return [(b.job_id, b.attempt_id, b.start, b.end, b.state) for b in row.bars]


def test_one_bar_per_attempt_in_the_window_and_one_row_per_host() -> None:
    state = history()
    index = timeline.build_index(state)
    rows, total, cursor = timeline.host_page(state, index, 0, 200, None, 100, None)
    assert total == 2 and cursor is None and [r.worker_id for r in rows] == ["w1", "w2"]
    assert bars(rows[0]) == [("j1", 0, 100, 110, "failed"), ("j2", 0, 105, 130, "succeeded"),
                             ("j1", 1, 120, None, "running")]
    assert rows[0].bars[2].started == 121
    assert rows[0].overlaps == [] and rows[1].bars == []  # tasks of no gang may share
    # A window keeps what overlaps it: ended before it, or assigned after it, is left out;
    # what still holds the host is in every window after its start.
    rows, *_ = timeline.host_page(state, index, 111, 119, None, 100, None)
    assert bars(rows[0]) == [("j2", 0, 105, 130, "succeeded")]
    rows, *_ = timeline.host_page(state, index, 500, 600, None, 100, None)
    assert bars(rows[0]) == [("j1", 1, 120, None, "running")]


def test_two_gangs_holding_one_host_at_once_are_named() -> None:
    """reserve.lua refuses this; were it ever logged, the row says so (the page marks it)."""
    state, _ = fold([
        at(1, registered("w1")), at(2, gang("j1")), at(2, gang("j2")),
        at(3, gang("j3", shareable=True)), at(3, gang("j4", shareable=True)),
        placed(10, "j1"), at(20, report(0, S.SUCCEEDED, 0, job="j1")),
        placed(15, "j2"), at(30, report(0, S.SUCCEEDED, 0, job="j2")),
        # Shareable gangs may share a host; one after another never overlaps.
        placed(40, "j3"), placed(41, "j4"),
    ])
    rows, *_ = timeline.host_page(state, timeline.build_index(state), 0, 100, None, 10, None)
    assert [b.group for b in rows[0].bars] == ["rack=r1"] * 4
    assert rows[0].overlaps == ["j1/0#0 and j2/0#0"]


def test_hosts_page_by_worker_id_and_the_filter_names_them() -> None:
    state = ClusterState()
    for i in range(7):
        state.apply(i + 1, registered(f"w{i}", f"i{i}"))
    seen: list[str] = []
    cursor: str | None = None
    while True:
        rows, total, cursor = timeline.host_page(state, {}, 0, 1, None, 3, cursor)
        assert total == 7 and len(rows) <= 3
        seen += [r.worker_id for r in rows]
        if cursor is None:
            break
    assert seen == [f"w{i}" for i in range(7)]
    rows, total, _ = timeline.host_page(state, {}, 0, 1, ["w5", "nope", "w1"], 10, None)
    assert [r.worker_id for r in rows] == ["w1", "w5"] and total == 2


def test_a_busy_host_is_bounded_and_says_so() -> None:
    events: list[AnyEvent] = [registered("w1"), submitted("j1", replicas=1)]
    state, _ = fold(events)
    job = state.jobs["j1"]
    # Many short attempts, more than the index keeps: the newest are kept, and one answer
    # shows at most MAX_BARS of them.
    from berth.shared.lifecycle import AttemptView
    index: dict[str, deque[timeline.HostAttempt]] = {}
    for i in range(timeline.HOST_HISTORY + 50):
        attempt = AttemptView(attempt_id=i, worker_id="w1", incarnation="i1",
                              assigned_at=float(i), finished_at=i + 0.5, exited=True)
        timeline.index_attempt(index, job, 0, attempt)
    assert len(index["w1"]) == timeline.HOST_HISTORY
    row = timeline.host_row(state, state.workers["w1"], index["w1"], 0, 10_000)
    assert len(row.bars) == timeline.MAX_BARS and row.truncated
    assert row.bars[-1].attempt_id == timeline.HOST_HISTORY + 49  # the newest kept


def test_cluster_samples_one_per_second_thinned_to_the_window() -> None:
    state = history()
    point = timeline.cluster_point(state, 121)
    assert (point.pending, point.assigned, point.running, point.hosts_busy,
            point.hosts_up) == (0, 0, 1, 1, 2)
    samples: deque[timeline.ClusterPoint] = deque(maxlen=100)
    for ts, busy in [(10.0, 1), (10.5, 2), (11.0, 3), (20.0, 0)]:
        timeline.record_point(samples, timeline.ClusterPoint(ts, 0, 0, 0, busy, 1))
    # Within a second the newer replaces the last: the newest is the state as it stands.
    assert [(p.ts, p.hosts_busy) for p in samples] == [(10.5, 2), (11.0, 3), (20.0, 0)]
    many = [timeline.ClusterPoint(float(t), t, 0, 0, 0, 0) for t in range(1000)]
    series = timeline.cluster_series(many, 100.5, 900, points=50)
    assert series[0].ts == 100  # in force when the window opens
    assert len(series) <= 51 and series[-1].ts == 900
    assert [p.ts for p in series] == sorted(p.ts for p in series)
    assert timeline.cluster_series(many, 2000, 3000) == [many[-1]]
    # The state as it stands ends the series: it replaces a sample of the same second.
    now = timeline.ClusterPoint(999.5, 7, 0, 0, 0, 0)
    assert timeline.cluster_series(many, 990, 1000, now)[-2:] == [many[-2], now]
    later = timeline.ClusterPoint(1500, 8, 0, 0, 0, 0)
    assert timeline.cluster_series(many, 990, 2000, later)[-2:] == [many[-1], later]


def test_the_quick_benchmark_checks_its_answers() -> None:
    """bench/timeline.py measures 10,000 hosts (docs/performance.md); its quick form, in
    process, checks each page holds every host's bars and the sample counts the running."""
    from bench.timeline import QUICK, measure
    result = measure(QUICK["hosts"], QUICK["attempts"])
    assert result["hosts"] == QUICK["hosts"]
    assert isinstance(result["page_100_hosts_bytes"], int) and result["page_100_hosts_bytes"]
