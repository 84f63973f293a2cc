"""Fair share within a band (docs/placement.md, "Fair share"): the pure order
(shared/queue_order.py) and the decayed usage the fold keeps (shared/usage.py)."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.shared import queue_order, state_snapshot, usage
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AttemptReported,
    GpuDevice,
    JobSpec,
    JobSubmitted,
    Priority,
    Resources,
    TaskAssigned,
    WorkerRegistered,
)
from berth.shared.states import TaskState

W = queue_order.Waiting
HOUR = 3600.0


def names(jobs: list[queue_order.Waiting]) -> list[str]:
    return [w.job_id for w in jobs]


@pytest.mark.parametrize(("jobs", "used", "expected"), [
    # One user: first come first served, whatever the sizes.
    ([W("a1", 1, "ann", 1, 5.0), W("a2", 1, "ann", 2, 1.0)], {}, ["a1", "a2"]),
    # Two users with no use, equal jobs, ann's burst first: interleaved one by one.
    ([W("a1", 1, "ann", 1, 1.0), W("a2", 1, "ann", 2, 1.0), W("a3", 1, "ann", 3, 1.0),
      W("b1", 1, "bob", 4, 1.0), W("b2", 1, "bob", 5, 1.0)], {},
     ["a1", "b1", "a2", "b2", "a3"]),
    # Bob's jobs are twice ann's: ann gets two for each of his.
    ([W(f"a{i}", 1, "ann", i, 1.0) for i in range(1, 5)]
     + [W(f"b{i}", 1, "bob", 10 + i, 2.0) for i in range(1, 3)], {},
     ["a1", "b1", "a2", "a3", "b2", "a4"]),
    # A user with no use goes before a heavy one, though he came later.
    ([W("h1", 1, "heavy", 1, 1.0), W("n1", 1, "new", 2, 1.0)], {"heavy": 50.0},
     ["n1", "h1"]),
    # Use counts until the newcomer's own queue has caught up with it.
    ([W("h1", 1, "heavy", 1, 1.0)] + [W(f"n{i}", 1, "new", 1 + i, 2.0) for i in range(1, 4)],
     {"heavy": 3.0}, ["n1", "n2", "h1", "n3"]),
    # Bands stay strictly ordered: a heavy user's production job before a batch job.
    ([W("b", 2, "new", 1, 1.0), W("p", 0, "heavy", 2, 1.0)], {"heavy": 1e9}, ["p", "b"]),
    # Each band is its own queue: charges in one do not push a user back in another.
    ([W("a1", 0, "ann", 1, 100.0), W("a2", 1, "ann", 2, 1.0), W("b1", 1, "bob", 3, 1.0)],
     {}, ["a1", "a2", "b1"]),
])
def test_fair_share_order_table(jobs: list[queue_order.Waiting], used: dict[str, float],
                                expected: list[str]) -> None:
    assert names(queue_order.order(jobs, used)) == expected


waiting_jobs = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["ann", "bob", "cy"]),
                                  st.floats(0.0, 10.0)), max_size=30).map(
    lambda rows: [W(f"j{i}", band, user, i, size) for i, (band, user, size) in enumerate(rows)])
usages = st.dictionaries(st.sampled_from(["ann", "bob", "cy"]), st.floats(0.0, 100.0))


@settings(max_examples=100, deadline=None)
@given(waiting_jobs, usages)
def test_fair_share_order_properties(jobs: list[queue_order.Waiting],
                                     used: dict[str, float]) -> None:
    ordered = queue_order.order(jobs, used)
    assert sorted(names(ordered)) == sorted(names(jobs))  # a permutation
    bands = [w.band for w in ordered]
    assert bands == sorted(bands)  # bands strictly first
    for user, band in {(w.user, w.band) for w in jobs}:  # a user's jobs FIFO in a band
        seqs = [w.seq for w in ordered if (w.user, w.band) == (user, band)]
        assert seqs == sorted(seqs)
    for band in set(bands):
        first = next(w for w in ordered if w.band == band)
        idle = {w.user for w in ordered if w.band == band and not used.get(w.user)}
        if idle:  # someone who has used nothing is placed first in the band
            assert first.user in idle


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 20), st.integers(1, 20))
def test_two_alternating_bursts_are_interleaved(ann: int, bob: int) -> None:
    """Equal users, equal jobs, each one burst: neither waits behind more than one job of
    the other until the other's burst is done."""
    jobs = ([W(f"a{i}", 1, "ann", i, 1.0) for i in range(ann)]
            + [W(f"b{i}", 1, "bob", 100 + i, 1.0) for i in range(bob)])
    users = [w.user for w in queue_order.order(jobs, {})]
    both = 2 * min(ann, bob)
    assert all(users[i] != users[i + 1] for i in range(both - 1))


def test_charge_counts_pending_tasks_weighted_devices_and_the_timeout() -> None:
    fair = usage.FairShare(half_life=HOUR, device_weight=10.0)
    state = ClusterState()
    state.apply(1, JobSubmitted(submit_seq=1, job_id="j1", ts=0.0, spec=JobSpec(
        name="t", command=["x"], replicas=3, timeout=60.0,
        resources=Resources(cpu=2, device=GpuDevice(variant="h100")))))
    job = state.jobs["j1"]
    assert queue_order.charge(job, 3, fair) == pytest.approx(3 * (2 + 10 * 1) * 60.0)
    job.spec = msgspec.structs.replace(job.spec, timeout=None)
    assert queue_order.charge(job, 1, fair) == pytest.approx(12 * HOUR)


def test_usage_decays_with_its_half_life_in_closed_form() -> None:
    d = usage.Decayed()
    usage.started(d, 2.0, 0.0, HOUR)
    # Running 2 cores for one hour: 2 * (1 - 1/2) * h / ln 2 core-seconds now.
    during = usage.use(d, HOUR, HOUR)
    assert during == pytest.approx(2 * 0.5 * HOUR / math.log(2))
    usage.ended(d, 2.0, 0.0, HOUR, HOUR)
    assert usage.use(d, HOUR, HOUR) == pytest.approx(during)
    assert usage.use(d, 2 * HOUR, HOUR) == pytest.approx(during / 2)  # a half-life later
    assert d.rate == 0 and d.live == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1000), st.floats(0, 1000), st.floats(0.1, 8)),
                max_size=8), st.floats(1, 10_000))
def test_usage_matches_the_sum_of_its_attempts(runs: list[tuple[float, float, float]],
                                               half_life: float) -> None:
    """Folded in any interleaving of starts and ends, the closed form equals the sum of
    each attempt's own decayed integral."""
    d = usage.Decayed()
    events = sorted([(s, 0, i) for i, (s, _, _) in enumerate(runs)]
                    + [(s + length, 1, i) for i, (s, length, _) in enumerate(runs)])
    for t, kind, i in events:
        start, _, rate = runs[i]
        if kind == 0:
            usage.started(d, rate, t, half_life)
        else:
            usage.ended(d, rate, start, t, half_life)
    now = max((t for t, _, _ in events), default=0.0) + 10.0
    k = math.log(2) / half_life
    expected = sum(r * (math.exp(-k * (now - s - length)) - math.exp(-k * (now - s))) / k
                   for s, length, r in runs)
    assert usage.use(d, now, half_life) == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_the_fold_derives_usage_from_the_log_and_a_snapshot_keeps_it() -> None:
    """What a new leader folds from the log is what the old one had: usage survives a
    fail-over, and a snapshot taken with another half-life is not continued."""
    state = ClusterState(usage_half_life=HOUR)
    gpus = GpuDevice(variant="h100", count=2)
    state.apply(1, WorkerRegistered(worker_id="w1", incarnation="i1", host="h", ts=0.0,
                                    resources=Resources(cpu=8, device=gpus)))
    spec = JobSpec(name="t", command=["x"], user="ann", priority=Priority.BATCH,
                   resources=Resources(cpu=2, device=GpuDevice(variant="h100")))
    state.apply(2, JobSubmitted(submit_seq=1, job_id="j1", ts=0.0, spec=spec))
    state.apply(3, TaskAssigned(job_id="j1", task_index=0, attempt_id=0, worker_id="w1",
                                incarnation="i1", epoch=0, ts=100.0))
    state.apply(4, AttemptReported(job_id="j1", task_index=0, attempt_id=0, worker_id="w1",
                                   state=TaskState.SUCCEEDED, exit_code=0,
                                   ts=100.0 + HOUR))
    fair = usage.FairShare(half_life=HOUR, device_weight=16.0)
    ran = 0.5 * HOUR / math.log(2)  # one hour, seen at its end
    assert queue_order.costs(state.recent_use, 100.0 + HOUR, fair)["ann"] == pytest.approx(
        (2 + 16) * ran)
    saved = state_snapshot.dump(state, "events@1")
    again = state_snapshot.load(saved, "events@1", 4, HOUR)
    assert again.recent_use == state.recent_use
    with pytest.raises(state_snapshot.UnusableSnapshot, match="half-life"):
        state_snapshot.load(saved, "events@1", 4, 60.0)
