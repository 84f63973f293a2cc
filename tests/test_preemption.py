"""Choosing preemption victims (services/scheduler/preemption.py): pure tables and
properties, and the fold's side of an eviction (shared/lifecycle.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.scheduler.placement import Host, Unit, place
from berth.services.scheduler.preemption import (
    LOWEST_BAND,
    Plan,
    Running,
    could_preempt,
    may_evict,
    plan,
)
from berth.shared.capacity import Amounts
from berth.shared.lifecycle import PREEMPTION_IDS_KEPT, ClusterState, Kill
from berth.shared.messages import (
    Coscheduling,
    JobSpec,
    JobSubmitted,
    PreemptionReleased,
    Priority,
    Resources,
    TaskAssigned,
    TasksPreempted,
    WorkerRegistered,
)
from berth.shared.states import TaskState

PROD, INTER, BATCH = (p.rank for p in (Priority.PRODUCTION, Priority.INTERACTIVE,
                                       Priority.BATCH))
CORE = Amounts(1000, 100)
SLICE = Amounts(4000, 1000, 0, 4)
FULL = Amounts()
GANG = Coscheduling(group_by="slice", order_by="rank")


def run(key: str, worker: str, band: int = BATCH, need: Amounts = CORE, gang: bool = False,
        started: float = 0.0, preemptible: bool = True) -> Running:
    return Running(key, key.split("/")[0], worker, band, need, gang, preemptible, started)


def host(name: str, free: Amounts, **attrs: str) -> Host:
    return Host(name, free, attributes=dict(attrs))


def task_unit(job: str = "p", need: Amounts = CORE) -> Unit:
    return Unit(job, (0,), need)


def gang_unit(job: str = "p", size: int = 2, need: Amounts = SLICE) -> Unit:
    return Unit(job, tuple(range(size)), need, gang=GANG)


def slice_hosts(name: str, size: int = 2, free: Amounts = FULL) -> list[Host]:
    return [host(f"{name}-{i}", free, slice=name, rank=str(i)) for i in range(size)]


@pytest.mark.parametrize(("band", "gang", "victim", "expected"), [
    (PROD, False, run("b/0/0", "h", BATCH), True),
    (INTER, False, run("b/0/0", "h", BATCH), True),
    (BATCH, False, run("b/0/0", "h", BATCH), False),  # never the same band
    (INTER, False, run("b/0/0", "h", INTER), False),
    (BATCH, False, run("b/0/0", "h", PROD), False),  # never a higher band
    (PROD, False, run("b/0/0", "h", BATCH, preemptible=False), False),
    # A waiting gang may evict a non-gang squatter of its own band, not a gang of it.
    (PROD, True, run("b/0/0", "h", PROD), True),
    (PROD, True, run("b/0/0", "h", PROD, gang=True), False),
    (INTER, True, run("b/0/0", "h", PROD), False),
])
def test_who_may_be_evicted(band: int, gang: bool, victim: Running, expected: bool) -> None:
    assert may_evict(band, gang, victim) is expected


def test_a_task_evicts_the_fewest_youngest_of_the_lowest_band() -> None:
    hosts = [host("a", Amounts(0, 1000)), host("b", Amounts(0, 1000))]
    running = [
        run("old/0/0", "a", started=1.0), run("young/0/0", "a", started=5.0),
        run("inter/0/0", "b", INTER, started=9.0),
    ]
    [p] = plan([(task_unit(), PROD)], hosts, running)
    assert p == Plan("p", ("young/0/0",), ("young",), ("a",), {"a": CORE})


@pytest.mark.parametrize(("running", "victims"), [
    # The lowest band wins over fewer victims.
    ([run("i/0/0", "a", INTER, Amounts(2000, 100)), run("b1/0/0", "b"),
      run("b2/0/0", "b")], ("b1/0/0", "b2/0/0")),
    # Fewer victims among one band.
    ([run("b1/0/0", "a", need=Amounts(2000, 100)), run("b2/0/0", "b"), run("b3/0/0", "b")],
     ("b1/0/0",)),
    # A victim that turns out not to be needed is dropped again: the young small one first,
    # then the big one suffices alone.
    ([run("small/0/0", "a", need=Amounts(500, 10), started=9.0),
      run("big/0/0", "a", need=Amounts(2000, 10), started=1.0)], ("big/0/0",)),
])
def test_victim_choice_table(running: list[Running], victims: tuple[str, ...]) -> None:
    hosts = [host("a", Amounts(0, 1000)), host("b", Amounts(0, 1000))]
    [p] = plan([(task_unit(need=Amounts(2000, 100)), PROD)], hosts, running)
    assert p.victims == victims


def test_nothing_to_gain_plans_nothing() -> None:
    hosts = [host("a", Amounts(0, 1000))]
    assert plan([(task_unit(), BATCH)], hosts, [run("b/0/0", "a")]) == []
    assert plan([(task_unit(), PROD)], hosts, [run("x/0/0", "a", PROD)]) == []
    too_big = task_unit(need=Amounts(5000, 100))
    assert plan([(too_big, PROD)], hosts, [run("b/0/0", "a")]) == []


def test_a_gang_is_evicted_whole_even_for_one_host() -> None:
    """A task needing one host evicts a batch gang spanning two: all of the gang goes."""
    hosts = [host("a", Amounts(0, 1000)), host("b", Amounts(0, 1000))]
    running = [run("g/0/0", "a", gang=True), run("g/1/0", "b", gang=True)]
    [p] = plan([(task_unit(), PROD)], hosts, running)
    assert p.victims == ("g/0/0", "g/1/0")
    assert p.hosts == ("a",)


def test_a_production_gang_evicts_two_batch_gangs_from_a_slice() -> None:
    """The issue's scenario: a 4-host slice runs two batch gangs of 2; a production gang of
    4 evicts both whole and holds the whole slice."""
    hosts = slice_hosts("s", 4)
    for h in hosts:
        h.holder = "g1" if h.worker_id in ("s-0", "s-1") else "g2"
    running = [run(f"g1/{i}/0", f"s-{i}", need=SLICE, gang=True) for i in (0, 1)] + [
        run(f"g2/{i}/0", f"s-{i + 2}", need=SLICE, gang=True) for i in (0, 1)]
    [p] = plan([(gang_unit(size=4), PROD)], hosts, running)
    assert p.victim_jobs == ("g1", "g2")
    assert len(p.victims) == 4
    assert p.hosts == ("s-0", "s-1", "s-2", "s-3")


def test_a_gang_takes_the_slice_whose_victims_cost_least() -> None:
    cheap = slice_hosts("cheap")
    dear = slice_hosts("dear")
    running = [run(f"b{i}/0/0", f"cheap-{i}", need=SLICE) for i in range(2)] + [
        run(f"i{i}/0/0", f"dear-{i}", INTER, need=SLICE) for i in range(2)]
    [p] = plan([(gang_unit(), PROD)], cheap + dear, running)
    assert p.hosts == ("cheap-0", "cheap-1")
    assert p.victim_jobs == ("b0", "b1")


def test_a_cpu_squatter_of_the_same_band_yields_to_a_gang() -> None:
    """Issue 15 item 2 (the Iris scenario): a production CPU task on one host of a slice
    blocks a production gang; it is evicted, not the gang left waiting forever."""
    hosts = slice_hosts("s", 2, free=SLICE)
    hosts[1].free = Amounts(3500, 900, 0, 4)  # the squatter holds half a core
    squatter = run("cpu/0/0", "s-1", PROD, Amounts(500, 100))
    assert place([gang_unit(need=SLICE)], hosts).pending_reasons
    [p] = plan([(gang_unit(), PROD)], hosts, [squatter])
    assert p.victims == ("cpu/0/0",)
    # A production task that opted out stays, and so does one of a gang.
    assert plan([(gang_unit(), PROD)], hosts,
                [run("cpu/0/0", "s-1", PROD, Amounts(500, 100), preemptible=False)]) == []
    assert plan([(task_unit(need=SLICE), PROD)], hosts, [squatter]) == []


def test_held_hosts_go_to_their_preemptor_only() -> None:
    hosts = [host("a", Amounts(0, 1000)), host("b", Amounts(0, 1000))]
    running = [run("b1/0/0", "a"), run("b2/0/0", "b")]
    first, second = plan([(task_unit("p1"), PROD), (task_unit("p2"), PROD)], hosts, running)
    assert first.hosts != second.hosts
    assert set(first.victims).isdisjoint(second.victims)
    hosts[0].held_for = hosts[1].held_for = "other"
    assert plan([(task_unit("p3"), PROD)], hosts, running) == []
    # The placement keeps held hosts for their preemptor too.
    free = [host("a", CORE), host("b", CORE)]
    free[0].held_for = "p1"
    result = place([task_unit("p9"), task_unit("p1")], free)
    assert {(a.job_id, a.worker_id) for a in result.assignments} == {("p9", "b"), ("p1", "a")}
    free[1].held_for = "p1"
    assert ("p9", 0) in place([task_unit("p9")], free).pending_reasons


# --- properties -----------------------------------------------------------------------------

bands = st.sampled_from([PROD, INTER, BATCH])


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[Host], list[Running]]:
    n = draw(st.integers(1, 4))
    hosts = [host(f"h{i}", Amounts(0, 0)) for i in range(n)]
    running = []
    for i in range(draw(st.integers(0, 10))):
        gang = draw(st.booleans())
        job = f"j{draw(st.integers(0, 5))}" + ("g" if gang else "")
        need = Amounts(draw(st.integers(1, 4)) * 500, 10)
        running.append(Running(f"{job}/{i}/0", job, f"h{draw(st.integers(0, n - 1))}",
                               draw(bands) if not gang else {"j": BATCH}.get(job[0], BATCH),
                               need, gang, draw(st.booleans()), draw(st.floats(0, 100))))
    return hosts, running


@settings(max_examples=100, deadline=None)
@given(clusters(), bands, st.integers(1, 6))
def test_a_plan_frees_enough_evicts_only_whom_it_may_and_no_victim_is_wasted(
        cluster: tuple[list[Host], list[Running]], band: int, cores: int) -> None:
    hosts, running = cluster
    need = Amounts(cores * 500, 10)
    by_key = {r.key: r for r in running}
    for p in plan([(task_unit(need=need), band)], hosts, running):
        [target] = p.hosts
        victims = [by_key[k] for k in p.victims]
        assert all(may_evict(band, False, v) or (v.gang and any(
            may_evict(band, False, w) for w in victims if w.job_id == v.job_id))
            for v in victims)
        freed = sum((v.need for v in victims if v.worker_id == target), Amounts())
        assert need.fits_in(freed)  # the hosts start full
        # Gangs are whole.
        for v in victims:
            if v.gang:
                assert {r.key for r in running if r.job_id == v.job_id} <= set(p.victims)
        # No victim unit could be spared (one-minimal).
        units = {(v.job_id if v.gang else v.key) for v in victims}
        for u in units:
            kept = sum((v.need for v in victims if v.worker_id == target
                        and (v.job_id if v.gang else v.key) != u), Amounts())
            assert not need.fits_in(kept)


@settings(max_examples=60, deadline=None)
@given(clusters(), st.lists(bands, min_size=1, max_size=4))
def test_several_preemptors_never_share_a_host_or_a_victim(
        cluster: tuple[list[Host], list[Running]], preemptors: list[int]) -> None:
    hosts, running = cluster
    units = [(task_unit(f"p{i}"), band) for i, band in enumerate(preemptors)]
    plans = plan(units, hosts, running)
    held = [h for p in plans for h in p.hosts]
    victims = [v for p in plans for v in p.victims]
    assert len(held) == len(set(held))
    assert len(victims) == len(set(victims))


# --- the fold ---------------------------------------------------------------------------------


def fold_with_victim(grace: float | None = 7.0) -> ClusterState:
    state = ClusterState()
    state.apply(1, WorkerRegistered(worker_id="w", incarnation="i", resources=Resources(
        cpu=1, memory_mb=100)))
    state.apply(2, JobSubmitted(job_id="b", submit_seq=1, spec=JobSpec(
        name="b", command=["x"], priority=Priority.BATCH, preemption_grace=grace,
        resources=Resources(cpu=1, memory_mb=100), max_retries_preemption=1)))
    state.apply(3, JobSubmitted(job_id="p", submit_seq=2, spec=JobSpec(
        name="p", command=["x"], priority=Priority.PRODUCTION,
        resources=Resources(cpu=1, memory_mb=100))))
    state.apply(4, TaskAssigned(job_id="b", task_index=0, attempt_id=0, worker_id="w",
                                incarnation="i", epoch=0))
    return state


def test_the_fold_stops_victims_with_their_grace_and_holds_the_host() -> None:
    state = fold_with_victim()
    event = TasksPreempted(id="e1", job_id="p", victims=["b/0/0"], hosts=["w"], epoch=0)
    effects = state.apply(5, event)
    assert effects == [Kill("w", "i", "b", 0, 0, "preempted by p", 7.0)]
    task = state.jobs["b"].tasks[0]
    assert task.state == TaskState.PENDING and task.preemption_count == 1  # retried
    assert task.attempts[0].error == "preempted by p"
    assert state.workers["w"].held_for == "p"
    assert state.jobs["p"].tasks[0].pending_reason.startswith("preempting 1 attempts of b")
    assert state.apply(6, event) == []  # folded once, however often it is delivered
    # A third job's assignment there is what the checker reports.
    state.apply(7, JobSubmitted(job_id="t", submit_seq=3, spec=JobSpec(name="t",
                                                                       command=["x"])))
    state.apply(8, TaskAssigned(job_id="t", task_index=0, attempt_id=0, worker_id="w",
                                incarnation="i", epoch=0))
    assert state.taken_from_preemptor == ["w: t/0/0 on a host held for preemptor p"]


def test_the_preemptor_placed_or_let_go_clears_the_hold() -> None:
    state = fold_with_victim()
    state.apply(5, TasksPreempted(id="e1", job_id="p", victims=["b/0/0"], hosts=["w"],
                                  epoch=0))
    state.apply(6, TaskAssigned(job_id="p", task_index=0, attempt_id=0, worker_id="w",
                                incarnation="i", epoch=0))
    assert state.workers["w"].held_for is None and state.holds == {}
    state = fold_with_victim()
    state.apply(5, TasksPreempted(id="e1", job_id="p", victims=["b/0/0"], hosts=["w"],
                                  epoch=0))
    state.apply(6, PreemptionReleased(id="e2", job_id="p", hosts=["w"], epoch=0))
    assert state.workers["w"].held_for is None and state.holds == {}


def test_the_preemption_ids_kept_are_a_bounded_window() -> None:
    """The leader folds its own event at once (seq 0) and again from the log: once. The
    ids folded are remembered only in a window, so they do not grow without bound."""
    state = fold_with_victim()
    event = TasksPreempted(id="e1", job_id="p", victims=["b/0/0"], hosts=["w"], epoch=0)
    assert state.apply(0, event) and state.apply(5, event) == []
    for n in range(PREEMPTION_IDS_KEPT + 10):
        state.apply(6 + n, PreemptionReleased(id=f"r{n}", job_id="p", hosts=["w"], epoch=0))
    assert len(state.preemption_events) == PREEMPTION_IDS_KEPT
    assert "e1" not in state.preemption_events and f"r{PREEMPTION_IDS_KEPT + 9}" in (
        state.preemption_events)


def test_a_victim_out_of_preemption_budget_is_finished() -> None:
    state = fold_with_victim()
    state.jobs["b"].tasks[0].preemption_count = 1
    state.apply(5, TasksPreempted(id="e1", job_id="p", victims=["b/0/0"], hosts=["w"],
                                  epoch=0))
    assert state.jobs["b"].tasks[0].state == TaskState.WORKER_FAILED
    assert state.jobs["b"].state.display == "failed"


@pytest.mark.parametrize(("spec", "error"), [
    ({"priority": "batch", "preemptible": False},
     "preemptible: false is only for priority production (this job is batch"),
    ({"preemption_grace": 0}, "Expected `float` > 0.0 - at `$.preemption_grace`"),
    ({"preemption_grace": 7200}, "Expected `float` <= 3600.0 - at `$.preemption_grace`"),
])
def test_spec_fields_are_validated_with_one_line(spec: dict[str, object], error: str) -> None:
    import msgspec

    with pytest.raises((msgspec.ValidationError, ValueError)) as info:
        msgspec.convert({"name": "x", "command": ["x"], **spec}, JobSpec)
    assert error in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("band", "lowest_running", "gang", "could"), [
    (0, 2, False, True),  # production over batch
    (1, 1, False, False),  # a task never evicts its own band
    (1, 1, True, True),  # a gang may evict its band's squatters
    (2, 2, True, False),  # the lowest band never preempts
    (0, -1, True, False),  # nothing runs
    (2, 1, False, False),  # only higher bands run
])
def test_who_could_preempt_agrees_with_may_evict(band: int, lowest_running: int, gang: bool,
                                                 could: bool) -> None:
    assert could_preempt(band, lowest_running, gang) is could
    # Against a squatter of the lowest band running, may_evict agrees, except that the
    # lowest band's units are never given the chance (the leader never plans for them).
    if lowest_running >= 0 and band < LOWEST_BAND:
        squatter = Running("v/0/0", "v", "w", lowest_running, Amounts(1000, 100), False,
                           True, 0.0)
        assert may_evict(band, gang, squatter) is could
