"""The scheduler's pending queue kept between ticks gives exactly the order that
shared/queue_order.py builds from scratch, whatever came and went before."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.scheduler.pending_queue import PendingQueue, Place
from berth.shared import queue_order
from berth.shared.capacity import Amounts

JOBS = 12
# job -> (band, user, seq, charge of one task); seqs unique, as submit sequences are.
job_specs = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from(["ann", "bob", "cy"]),
              st.sampled_from([0.0, 0.5, 1.0, 3.0])),
    min_size=JOBS, max_size=JOBS)
# Each step: the pending tasks as a set of (job, task index), and the held ones among them.
steps = st.lists(
    st.tuples(st.sets(st.tuples(st.integers(0, JOBS - 1), st.integers(0, 3))),
              st.sets(st.tuples(st.integers(0, JOBS - 1), st.integers(0, 3)), max_size=3)),
    min_size=1, max_size=8)
use = st.dictionaries(st.sampled_from(["ann", "bob", "cy"]), st.sampled_from([0.0, 1.0, 2.5]))
# The most any host has free (HostIndex.most_free): the jobs of needs beyond it are left out.
most_free = st.builds(Amounts, st.sampled_from([250, 500, 750]), st.sampled_from([0, 100, 300]),
                      st.just(0), st.integers(0, 1))


def from_scratch(pending: set[tuple[str, int]], held: set[tuple[str, int]],
                 specs: dict[str, tuple[int, str, int, float]],
                 used: dict[str, float]) -> list[str]:
    """The scheduler's order before the queue was kept: group, key and sort everything."""
    by_job: dict[str, int] = {}
    for job_id, index in pending:
        if (job_id, index) not in held:
            by_job[job_id] = by_job.get(job_id, 0) + 1
    waiting = [queue_order.Waiting(j, specs[j][0], specs[j][1], specs[j][2], specs[j][3] * n)
               for j, n in by_job.items()]
    return [w.job_id for w in queue_order.order(waiting, used)]


@settings(max_examples=150, deadline=None)
@given(job_specs, steps, use, most_free)
def test_kept_order_equals_the_order_built_from_scratch(
        specs_list: list[tuple[int, str, float]],
        history: list[tuple[set[tuple[int, int]], set[tuple[int, int]]]],
        used: dict[str, float], most: Amounts) -> None:
    """Also with the jobs of needs beyond the most any host has free left out: the order
    of the others, as if those did not wait."""
    specs = {f"j{n}": (band, user, 100 - 7 * n if n % 2 else 10 + n, charge)
             for n, (band, user, charge) in enumerate(specs_list)}
    def need(job_id: str) -> Amounts:  # what one task of each job needs
        n = int(job_id[1:])
        return Amounts(250 * (n % 3 + 1), 100 * (n % 4), 0, n % 2)

    def need_of(job_id: str) -> tuple[Amounts, bool]:
        return need(job_id), int(job_id[1:]) % 5 == 0  # every fifth job a gang

    queue = PendingQueue(need_of)
    # The same queue kept from the fold's changes (ClusterState.pending_changes) instead.
    kept = PendingQueue(need_of)
    before: set[tuple[str, int]] = set()
    for tasks, held_raw in history:
        pending = {(f"j{j}", i): None for j, i in sorted(tasks)}
        held = {(f"j{j}", i) for j, i in held_raw} & pending.keys()
        queue.sync(pending, lambda j: Place(specs[j][0], specs[j][1], specs[j][2], need(j)))
        # What the fold records: the last change of each key, including keys that left and
        # came back (True, present before and after) or came and left (False, in neither).
        changes = {key: key in pending for key in before ^ pending.keys()}
        changes |= {key: True for key in sorted(before & pending.keys())[::2]}
        changes |= {(f"j{n}", 9): False for n in range(2)}  # came and left in between
        kept.apply(changes, lambda j: Place(specs[j][0], specs[j][1], specs[j][2], need(j)))
        before = set(pending)

        def charge(job_id: str, held: set[tuple[str, int]] = held) -> float | None:
            n = sum((job_id, i) not in held for i in queue.tasks(job_id))
            return specs[job_id][3] * n if n else None

        expected = from_scratch(set(pending), held, specs, used)
        assert list(queue.ordered(used, charge)) == expected
        assert list(kept.ordered(used, charge)) == expected
        beyond = queue.needs_beyond(most)
        assert beyond == kept.needs_beyond(most) == {
            need(j) for j, _ in pending if not need(j).fits_in(most)}
        fitting = {key for key in pending if need(key[0]).fits_in(most)}
        assert list(kept.ordered(used, charge, beyond)) == from_scratch(
            fitting, held, specs, used)
        assert kept.keys() == queue.keys() == pending.keys()
        assert all(kept.filed(key) and queue.filed(key) for key in pending)
        # A job is listed (has an entry in its queue) exactly when it has a place.
        for q in (queue, kept):
            assert all(list(zip(queue_.seqs, queue_.jobs, strict=True)) ==
                       sorted(zip(queue_.seqs, queue_.jobs, strict=True))
                       for queue_ in q.queues.values())
            assert {j for queue_ in q.queues.values() for j in queue_.jobs} == \
                q.places.keys()
        assert {j: set(kept.tasks(j)) for j in kept.indices} == \
            {j: set(queue.tasks(j)) for j in queue.indices}
        assert {j: set(queue.tasks(j)) for j in queue.indices} == {
            j: {i for jj, i in pending if jj == j} for j, _ in pending}
        # The least need and the top band of what is filed, kept from the same changes.
        needs = [need(j) for j in {j for j, _ in pending}]
        least = Amounts(*(min(getattr(n, d) for n in needs) for d in ("cpu", "mem", "disk",
                                                                        "dev"))) if needs else None
        assert queue.least_need() == kept.least_need() == least
        fit = [need(j) for j in {j for j, _ in fitting}]
        assert kept.least_need(beyond) == (Amounts(*(min(getattr(n, d) for n in fit) for d in (
            "cpu", "mem", "disk", "dev"))) if fit else None)
        top = min((specs[j][0] for j, _ in pending), default=None)
        assert queue.top_band() == kept.top_band() == top
        gangs = any(int(j[1:]) % 5 == 0 for j, _ in pending)
        assert queue.gang_waits() == kept.gang_waits() == gangs


def test_a_long_consumed_front_is_dropped_and_a_requeued_job_found_again() -> None:
    queue = PendingQueue()
    place = {f"j{n}": Place(0, "ann", n) for n in range(10_000)}
    queue.sync({(j, 0): None for j in place}, place.__getitem__)
    queue.sync({(f"j{n}", 0): None for n in range(9_000, 10_000)}, place.__getitem__)
    first = list(queue.ordered({}, lambda j: 1.0))
    assert first == [f"j{n}" for n in range(9_000, 10_000)]
    assert len(queue.queues[(0, "ann", Amounts())].jobs) <= 2 * 1_000 + 64  # dead ones dropped
    # A task of an early job waits again (a retry): it goes back to its place in the order.
    queue.sync({(f"j{n}", 0): None for n in [5, *range(9_000, 10_000)]}, place.__getitem__)
    assert list(queue.ordered({}, lambda j: 1.0))[:2] == ["j5", "j9000"]


def test_the_least_need_is_unknown_once_a_job_left_the_fold() -> None:
    needs = {"a": (Amounts(1000, 100), False), "b": (Amounts(500, 200), True)}
    queue = PendingQueue(needs.get)
    place = {"a": Place(0, "u", 1), "b": Place(0, "u", 2)}
    queue.apply({("a", 0): True, ("b", 0): True, ("b", 1): True}, place.__getitem__)
    assert queue.least_need() == Amounts(500, 100) and queue.gang_waits()
    queue.apply({("b", 0): False}, place.__getitem__)  # b still has task 1 waiting
    assert queue.least_need() == Amounts(500, 100)
    queue.apply({("b", 1): False}, place.__getitem__)
    assert queue.least_need() == Amounts(1000, 100) and not queue.gang_waits()
    del needs["a"]  # compacted away before its tasks' departure was filed
    queue.apply({("a", 0): False}, place.__getitem__)
    assert queue.least_need() is None
    queue.apply({("b", 0): True}, place.__getitem__)
    assert queue.least_need() is None  # not trusted again in this queue's life
    assert queue.gang_waits()
    assert PendingQueue().least_need() is None  # without need_of


def test_a_queue_position_is_that_of_its_seq_then_job_id() -> None:
    # The entries are two lists sorted together, as the (seq, job id) pairs they replace
    # were: equal seqs (never from one stream, but cheap to keep right) by job id.
    from berth.services.scheduler.pending_queue import _Queue

    queue = _Queue((0, "ann"), seqs=[3, 5, 5, 5, 9], jobs=["a", "b", "d", "f", "c"])
    pairs = list(zip(queue.seqs, queue.jobs, strict=True))
    for seq, job_id in [(1, "z"), (3, "a"), (4, "a"), (5, "a"), (5, "c"), (5, "d"),
                        (5, "e"), (5, "g"), (9, "c"), (10, "a")]:
        expected = sum(pair < (seq, job_id) for pair in pairs)
        assert queue.position(seq, job_id) == expected, (seq, job_id)
