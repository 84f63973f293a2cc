"""Placement and constraint matching: pure functions, table tests and properties."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.scheduler import placement
from berth.services.scheduler.host_index import HostIndex
from berth.services.scheduler.matching import holds, matches, preference
from berth.services.scheduler.placement import Host, Unit, place
from berth.shared.capacity import Amounts
from berth.shared.messages import Constraint, ConstraintMode, Coscheduling, Op


def cpu(milli: int, mem: int = 100) -> Amounts:
    return Amounts(cpu=milli, mem=mem)


ONE_CORE = Amounts(cpu=1000, mem=100)
SLICE_HOST = Amounts(4000, 1000, 0, 4)


def task(job: str, *indices: int, need: Amounts = ONE_CORE, **kw: object) -> Unit:
    return Unit(job, indices, need, **kw)  # type: ignore[arg-type]


def as_given(hosts: list[Host]) -> list[tuple[object, ...]]:
    """Every field of every host, by value: `place` works on the hosts it is given in
    place and must leave each as it was (the scheduler reuses them from tick to tick)."""
    return [(h.worker_id, h.free, h.device_kind, dict(h.attributes), h.address, h.holder,
             set(h.ports_used), None if h.free_devices is None else list(h.free_devices),
             h.out_of_service, h.held_for) for h in hosts]


def test_spreads_replicas_and_respects_capacity() -> None:
    hosts = [Host("a", cpu(2000, 1000)), Host("b", cpu(2000, 1000))]
    result = place([task("j", 0, 1, 2)], hosts)
    assert [a.worker_id for a in result.assignments] == ["a", "b", "a"]
    assert result.pending_reasons == {}


def test_pending_reason_names_the_shortfall() -> None:
    hosts = [Host("a", cpu(2000, 4096)), Host("b", cpu(1000, 2048))]
    result = place([task("j", 0, need=cpu(1000, 16384))], hosts)
    assert result.assignments == []
    assert result.pending_reasons[("j", 0)] == (
        "insufficient memory: need 16384 MiB, largest free 4096 MiB on 2 workers")
    result = place([task("j", 0, need=cpu(4000, 10))], hosts)
    assert result.pending_reasons[("j", 0)] == (
        "insufficient cpu: need 4 cores, largest free 2 cores on 2 workers")
    assert place([task("j", 0)], []).pending_reasons[("j", 0)] == "no live workers"
    pool = (Constraint(key="pool", op=Op.EQ, value="tpu"),)
    assert place([task("j", 0, constraints=pool)], hosts).pending_reasons[("j", 0)] == (
        "no worker matches constraints: pool EQ tpu")
    tpu = Amounts(1000, 100, 0, 4)
    assert place([task("j", 0, need=tpu, device_kind="tpu:v5p:2x2x1")], hosts
                 ).pending_reasons[("j", 0)] == "no matching worker has device tpu:v5p:2x2x1"


ATTRS = {"region": "us", "zone": "us-a", "gen": "5", "pool": "tpu"}


@pytest.mark.parametrize(
    ("op", "key", "value", "values", "expected"),
    [
        (Op.EQ, "zone", "us-a", None, True), (Op.EQ, "zone", "us-b", None, False),
        (Op.EQ, "missing", "x", None, False),
        (Op.NE, "zone", "us-b", None, True), (Op.NE, "zone", "us-a", None, False),
        (Op.NE, "missing", "x", None, True),
        (Op.IN, "zone", None, ["us-b", "us-a"], True), (Op.IN, "zone", None, ["eu"], False),
        (Op.EXISTS, "pool", None, None, True), (Op.EXISTS, "missing", None, None, False),
        (Op.NOT_EXISTS, "missing", None, None, True), (Op.NOT_EXISTS, "pool", None, None, False),
        (Op.GT, "gen", "4", None, True), (Op.GT, "gen", "5", None, False),
        (Op.GE, "gen", "5", None, True), (Op.LT, "gen", "10", None, True),
        (Op.LT, "gen", "5", None, False), (Op.LE, "gen", "5", None, True),
        (Op.GT, "zone", "1", None, False),  # not a number: no comparison holds
        (Op.GT, "missing", "1", None, False),
    ],
)
def test_constraint_operators(op: Op, key: str, value: str | None, values: list[str] | None,
                              expected: bool) -> None:
    assert holds(ATTRS, Constraint(key=key, op=op, value=value, values=values)) is expected


def test_tasks_with_an_in_constraint_are_placed_and_left_waiting_without_raising() -> None:
    """An IN constraint's values, decoded from a submit as a JSON list, once made the
    constraint unhashable: the tick raised on the first such task (placement keys its
    caches by constraints), and every scheduler stopped on the same waiting job."""
    spec = msgspec.json.decode(b'{"key": "zone", "op": "IN", "values": ["us-a", "us-b"]}',
                               type=Constraint)
    nowhere = Constraint(key="zone", op=Op.IN, values=["eu"])  # built from a list
    hosts = [Host("h1", Amounts(4000, 1000), "", dict(ATTRS))]
    result = place([Unit("j1", (0, 1), Amounts(cpu=1000, mem=10), constraints=(spec,)),
                    Unit("j2", (0,), Amounts(cpu=1000, mem=10), constraints=(nowhere,))],
                   hosts)
    assert [(a.job_id, a.task_index) for a in result.assignments] == [("j1", 0), ("j1", 1)]
    assert "zone IN [eu]" in result.pending_reasons[("j2", 0)]


def test_all_constraints_must_hold() -> None:
    both = [Constraint(key="region", op=Op.EQ, value="us"),
            Constraint(key="gen", op=Op.GE, value="6")]
    assert not matches(ATTRS, both)
    assert matches(ATTRS, both[:1])
    assert matches(ATTRS, [])


def slice_hosts(name: str, n: int, free: Amounts = SLICE_HOST,
                holder: str | None = None) -> list[Host]:
    # Worker ids deliberately out of tpu-worker-id order.
    return [Host(f"{name}-w{n - 1 - i}", free, "tpu:v5p:2x2x1",
                 {"tpu-name": name, "tpu-worker-id": str(i)}, f"10.0.{len(name)}.{i}", holder)
            for i in range(n)]


GANG = Coscheduling(group_by="tpu-name", order_by="tpu-worker-id")
CHIPS = Amounts(1000, 100, 0, 4)


def gang(job: str, n: int = 4, ports: tuple[str, ...] = ("coord",)) -> Unit:
    return Unit(job, tuple(range(n)), CHIPS, "tpu:v5p:2x2x1", (), ports, GANG)


def test_a_gang_goes_whole_to_one_group_in_worker_order() -> None:
    hosts = slice_hosts("a", 4) + slice_hosts("b", 4)
    result = place([gang("g1")], hosts)
    by_index = {a.task_index: a for a in result.assignments}
    # Task i on tpu-worker-id i, all on slice a, coordinator = task 0's address and port.
    assert [by_index[i].worker_id for i in range(4)] == ["a-w3", "a-w2", "a-w1", "a-w0"]
    assert {a.group for a in result.assignments} == {"tpu-name=a"}
    assert {a.coordinator for a in result.assignments} == {"10.0.1.0:30000"}
    (claim,) = result.groups
    assert claim.job_id == "g1" and claim.exclusive and len(claim.members) == 4


def test_three_gangs_in_one_tick_onto_two_slices_never_share_a_host() -> None:
    """The incident: simultaneous dispatch of same-shape gangs."""
    hosts = slice_hosts("a", 4) + slice_hosts("b", 4)
    result = place([gang("g1"), gang("g2"), gang("g3")], hosts)
    placed = {a.job_id for a in result.assignments}
    assert placed == {"g1", "g2"}
    hosts_of = {j: {a.worker_id for a in result.assignments if a.job_id == j} for j in placed}
    assert hosts_of["g1"].isdisjoint(hosts_of["g2"])
    assert {c.name: c.job_id for c in result.groups} == {"tpu-name=a": "g1", "tpu-name=b": "g2"}
    assert set(result.pending_reasons) == {("g3", i) for i in range(4)}
    reason = result.pending_reasons[("g3", 0)]
    assert "tpu-name=a held by g1" in reason and "tpu-name=b held by g2" in reason


def test_a_held_group_is_not_given_to_another_gang_even_with_room() -> None:
    hosts = slice_hosts("a", 8, Amounts(8000, 8000, 0, 8), holder="old")
    assert place([gang("new")], hosts).assignments == []
    assert place([gang("old")], hosts).assignments  # the holder's own retry may use it


def test_a_gang_waits_when_its_group_is_short_and_never_commits_part() -> None:
    hosts = slice_hosts("a", 3)
    result = place([gang("g1")], hosts)
    assert result.assignments == [] and result.groups == []
    assert result.pending_reasons[("g1", 0)] == (
        "no tpu-name group can take all 4 tasks: tpu-name=a has 3 matching workers, needs 4")


def test_ports_are_distinct_per_host_and_skip_ports_in_use() -> None:
    hosts = [Host("a", cpu(8000, 1000), ports_used={30000})]
    result = place([task("j", 0, 1, need=cpu(100, 10), ports=("http", "grpc"))], hosts)
    ports = [p for a in result.assignments for p in a.ports.values()]
    assert sorted(ports) == [30001, 30002, 30003, 30004]


@pytest.mark.parametrize(
    ("addresses", "used", "expected"),
    [
        # Four workers on one address: four distinct ports (the `berth up` case).
        (["127.0.0.1"] * 4, {}, [30000, 30001, 30002, 30003]),
        # A port taken by one worker's attempt is taken for every worker at the address.
        (["127.0.0.1"] * 4, {0: {30000, 30002}}, [30001, 30003, 30004, 30005]),
        # Workers on distinct addresses may each use the lowest port.
        (["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"], {}, [30000] * 4),
        # No address: the worker is its own unit.
        (["", "", "", ""], {}, [30000] * 4),
        # Two addresses, two workers each.
        (["a", "a", "b", "b"], {2: {30000}}, [30000, 30001, 30001, 30002]),
    ],
)
def test_named_ports_are_allocated_per_address(
        addresses: list[str], used: dict[int, set[int]], expected: list[int]) -> None:
    hosts = [Host(f"w{i}", cpu(1000, 1000), address=addr, ports_used=set(used.get(i, ())))
             for i, addr in enumerate(addresses)]
    result = place([task("j", 0, 1, 2, 3, ports=("http",))], hosts)
    by_worker = {a.worker_id: a.ports["http"] for a in result.assignments}
    assert [by_worker[f"w{i}"] for i in range(4)] == expected


def test_a_gang_on_one_address_gets_distinct_ports_and_coordinator() -> None:
    hosts = [Host(f"w{i}", cpu(1000, 1000), address="127.0.0.1", attributes={"rack": "r"})
             for i in range(3)]
    result = place([Unit("g", (0, 1, 2), ONE_CORE, "", (), ("coord",),
                         Coscheduling(group_by="rack"))], hosts)
    assert sorted(a.ports["coord"] for a in result.assignments) == [30000, 30001, 30002]
    assert {a.coordinator for a in result.assignments} == {"127.0.0.1:30000"}


def test_priority_order_is_the_callers() -> None:
    hosts = [Host("a", cpu(1000))]
    result = place([task("prod", 0), task("batch", 0)], hosts)
    assert [a.job_id for a in result.assignments] == ["prod"]
    assert ("batch", 0) in result.pending_reasons


@given(
    st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 4096), st.integers(0, 2)),
             max_size=30),
    st.lists(st.tuples(st.integers(0, 8000), st.integers(0, 8192)), max_size=8),
    st.integers(0, 3),
)
def test_never_over_commits_a_host_nor_shares_a_group(
        tasks: list[tuple[int, int, int]], hosts: list[tuple[int, int]], gangs: int) -> None:
    units = [task(f"t{i}", 0, need=cpu(c, m), ports=("p",) * min(n, 1))
             for i, (c, m, n) in enumerate(tasks)]
    units += [Unit(f"g{k}", (0, 1), cpu(500, 10), "", (), ("coord",),
                   Coscheduling(group_by="rack")) for k in range(gangs)]
    # Some hosts share an address: ports must be distinct per address, not per worker.
    caps = [Host(f"h{i}", cpu(c, m), attributes={"rack": str(i % 3)}, address=f"ip{i % 2}",
                 ports_used={30000 + i % 4})
            for i, (c, m) in enumerate(hosts)]
    before = as_given(caps)
    result = place(units, caps)
    assert as_given(caps) == before
    # No port a host at the same address already used is given out.
    for a in result.assignments:
        address = next(h.address for h in caps if h.worker_id == a.worker_id)
        in_use = set().union(*(h.ports_used for h in caps if h.address == address))
        assert in_use.isdisjoint(a.ports.values())
    used: dict[str, Amounts] = {}
    ports: set[tuple[str, int]] = set()  # (address, port)
    for a in result.assignments:
        unit = next(u for u in units if u.job_id == a.job_id)
        used[a.worker_id] = used.get(a.worker_id, Amounts()) + unit.need
        address = next(h.address for h in caps if h.worker_id == a.worker_id)
        for port in a.ports.values():
            assert (address, port) not in ports
            ports.add((address, port))
    for cap in caps:
        assert used.get(cap.worker_id, Amounts()).fits_in(cap.free)
    placed = {(a.job_id, a.task_index) for a in result.assignments}
    assert placed.isdisjoint(result.pending_reasons)
    assert len(placed) + len(result.pending_reasons) == len(tasks) + 2 * gangs
    # A gang is whole or absent, and no two gangs hold one group.
    for k in range(gangs):
        mine = [a for a in result.assignments if a.job_id == f"g{k}"]
        assert len(mine) in (0, 2)
    owners = [c.name for c in result.groups]
    assert len(owners) == len(set(owners))


def naive_place(units: list[Unit], hosts: list[Host]) -> list[tuple[str, int, str]]:
    """The reference: for each task, scan every host; of those that fit, the most preferred
    constraints held, then the most free cpu, ties to the lowest worker id (what
    placement's heaps must reproduce exactly)."""
    free = {h.worker_id: h.free for h in hosts}
    chosen = []
    for unit in units:
        for index in unit.indices:
            best = None
            for h in hosts:
                if not matches(h.attributes, unit.constraints):
                    continue
                if unit.need.dev and h.device_kind != unit.device_kind:
                    continue
                if not unit.need.fits_in(free[h.worker_id]):
                    continue
                if h.out_of_service:
                    continue

                def rank(x: Host, c: tuple[Constraint, ...] = unit.constraints
                         ) -> tuple[int, int]:
                    return (preference(x.attributes, c), free[x.worker_id].cpu)

                if best is None or (rank(h), best.worker_id) > (rank(best), h.worker_id):
                    best = h
            if best is not None:
                free[best.worker_id] = free[best.worker_id] - unit.need
                chosen.append((unit.job_id, index, best.worker_id))
    return chosen


@settings(max_examples=300, deadline=None)
@given(
    # A need of 0 millicores (cpu under 0.0005) fits a host with no cpu free.
    st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 3000), st.integers(0, 2),
                       st.sampled_from(["", "a", "b"]), st.sampled_from(["", "x", "y"])),
             max_size=40),
    st.lists(st.tuples(st.integers(0, 6000), st.integers(0, 6000), st.integers(0, 4),
                       st.sampled_from(["a", "b"]), st.sampled_from(["x", "y"]),
                       st.booleans()), max_size=12),
)
def test_single_task_placement_equals_a_scan_of_every_host(
        tasks: list[tuple[int, int, int, str, str]],
        hosts: list[tuple[int, int, int, str, str, bool]]) -> None:
    def constraints(pool: str, zone: str) -> tuple[Constraint, ...]:
        out = [Constraint(key="pool", op=Op.EQ, value=pool)] if pool else []
        if zone:
            out.append(Constraint(key="zone", op=Op.EQ, value=zone,
                                  mode=ConstraintMode.PREFERRED))
        return tuple(out)

    units = [task(f"t{i}", 0, 1, need=Amounts(c, m, 0, d),
                  device_kind="gpu:x" if d else "", constraints=constraints(pool, zone))
             for i, (c, m, d, pool, zone) in enumerate(tasks)]
    caps = [Host(f"h{i:02d}", Amounts(c, m, 0, d), "gpu:x" if d else "",
                 {"pool": pool, "zone": zone}, out_of_service="cordoned" if away else "")
            for i, (c, m, d, pool, zone, away) in enumerate(hosts)]
    expected = naive_place(units, [Host(h.worker_id, h.free, h.device_kind, h.attributes,
                                        out_of_service=h.out_of_service) for h in caps])
    result = place(units, caps)
    assert [(a.job_id, a.task_index, a.worker_id) for a in result.assignments] == expected
    assert len(result.assignments) + len(result.pending_reasons) == 2 * len(tasks)


def test_a_limit_stops_placing_without_splitting_a_gang_and_says_so() -> None:
    hosts = [Host(f"h{i}", Amounts(cpu=4000, mem=4096), attributes={"slice": f"s{i // 2}"})
             for i in range(4)]
    singles = Unit("j1", tuple(range(5)), Amounts(cpu=1000, mem=10))
    gang = Unit("j2", (0, 1), Amounts(cpu=1000, mem=10),
                gang=Coscheduling(group_by="slice"))
    limited = place([singles, gang, singles_of("j3", 2)], hosts, limit=3)
    assert limited.truncated and len(limited.assignments) == 3
    assert {a.job_id for a in limited.assignments} == {"j1"}
    at_six = place([singles, gang, singles_of("j3", 2)], hosts, limit=6)
    assert at_six.truncated  # the gang went whole (7 placed), j3 was not examined
    assert [a.job_id for a in at_six.assignments].count("j2") == 2
    assert all(a.job_id != "j3" for a in at_six.assignments)
    unlimited = place([singles, gang, singles_of("j3", 2)], hosts)
    assert not unlimited.truncated and len(unlimited.assignments) == 9


def singles_of(job_id: str, n: int) -> Unit:
    return Unit(job_id, tuple(range(n)), Amounts(cpu=1000, mem=10))


def test_one_gpu_tasks_get_distinct_free_devices_and_a_third_waits_naming_the_gpus() -> None:
    host = Host("g", Amounts(4000, 1000, 0, 2), "gpu:h100", free_devices=[0, 1])
    need = Amounts(1000, 10, 0, 1)
    result = place([task("j", 0, 1, 2, need=need, device_kind="gpu:h100")], [host])
    assert [a.devices for a in result.assignments] == [(0,), (1,)]
    assert result.pending_reasons[("j", 2)] == (
        "insufficient h100 GPUs: need 1, largest free 0 on 1 worker")


def test_devices_held_by_live_attempts_are_never_given_again() -> None:
    # Devices 0 and 2 held: the free ones are 1 and 3, whatever the count says.
    host = Host("g", Amounts(4000, 1000, 0, 3), "gpu:h100", free_devices=[3, 1])
    result = place([task("j", 0, need=Amounts(100, 1, 0, 2), device_kind="gpu:h100"),
                    task("k", 0, need=Amounts(100, 1, 0, 1), device_kind="gpu:h100")], [host])
    assert [a.devices for a in result.assignments] == [(1, 3)]
    assert "need 1, largest free 0" in result.pending_reasons[("k", 0)]


def test_the_lowest_free_device_goes_first_whatever_the_order_listed() -> None:
    # Counted right (two free, two listed), listed out of order.
    host = Host("g", Amounts(4000, 1000, 0, 2), "gpu:h100", free_devices=[3, 1])
    result = place([task("j", 0, 1, need=Amounts(100, 1, 0, 1), device_kind="gpu:h100")],
                   [host])
    assert [a.devices for a in result.assignments] == [(1,), (3,)]
    assert host.free_devices == [3, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.booleans()), max_size=20),
       st.lists(st.lists(st.integers(0, 7), max_size=8, unique=True), min_size=1, max_size=4),
       st.lists(st.integers(0, 2), min_size=4, max_size=4))
def test_no_device_is_ever_given_twice(needs: list[tuple[int, bool]],
                                       free: list[list[int]], unlisted: list[int]) -> None:
    """Singles and two-task gangs on hosts with arbitrary free device sets, in any order,
    some counting more devices free than they list (an unhealthy one is counted, never
    listed): each assignment gets exactly its count of distinct devices, all listed free
    before, none given twice."""
    hosts = [Host(f"h{i}", Amounts(64000, 64000, 0, len(f) + unlisted[i]), "gpu:x",
                  {"rack": "r"}, free_devices=list(f)) for i, f in enumerate(free)]
    units = [Unit(f"j{i}", (0, 1) if gang else (0,), Amounts(10, 1, 0, n), "gpu:x",
                  gang=Coscheduling(group_by="rack", shareable=True) if gang else None)
             for i, (n, gang) in enumerate(needs)]
    before = as_given(hosts)
    result = place(units, hosts)
    assert as_given(hosts) == before
    given: set[tuple[str, int]] = set()
    for a in result.assignments:
        need = next(u.need.dev for u in units if u.job_id == a.job_id)
        assert len(a.devices) == need == len(set(a.devices))
        for d in a.devices:
            assert d in free[int(a.worker_id[1:])]
            assert (a.worker_id, d) not in given
            given.add((a.worker_id, d))


PREFER_EU = (Constraint(key="zone", op=Op.EQ, value="eu", mode=ConstraintMode.PREFERRED),)


@pytest.mark.parametrize(("hosts", "expected"), [
    # The preferred host wins though the other has more free cpu.
    ([Host("a", cpu(8000, 1000), attributes={"zone": "us"}),
      Host("b", cpu(2000, 1000), attributes={"zone": "eu"})], ["b", "b", "a"]),
    # No host satisfies the preference: placed anyway, by free cpu.
    ([Host("a", cpu(2000, 1000), attributes={"zone": "us"}),
      Host("b", cpu(2000, 1000))], ["a", "b", "a"]),
    # The preferred host is out of service: never chosen, the preference gives way.
    ([Host("a", cpu(2000, 1000), attributes={"zone": "us"}),
      Host("b", cpu(8000, 1000), attributes={"zone": "eu"}, out_of_service="cordoned: by ops")],
     ["a", "a"]),
])
def test_a_preferred_constraint_ranks_hosts_and_never_rules_one_out(
        hosts: list[Host], expected: list[str]) -> None:
    result = place([task("j", 0, 1, 2, constraints=PREFER_EU)], hosts)
    assert [a.worker_id for a in result.assignments] == expected


def test_more_preferences_held_beat_fewer() -> None:
    prefs = (*PREFER_EU, Constraint(key="disk", op=Op.EQ, value="ssd",
                                     mode=ConstraintMode.PREFERRED))
    hosts = [Host("a", cpu(4000, 1000), attributes={"zone": "eu"}),
             Host("b", cpu(1000, 1000), attributes={"zone": "eu", "disk": "ssd"}),
             Host("c", cpu(8000, 1000), attributes={"disk": "hdd"})]
    result = place([task("j", 0, 1, constraints=prefs)], hosts)
    assert [a.worker_id for a in result.assignments] == ["b", "a"]


def test_a_required_constraint_still_rules_out_and_the_reason_names_only_it() -> None:
    both = (Constraint(key="pool", op=Op.EQ, value="tpu"), *PREFER_EU)
    result = place([task("j", 0, constraints=both)], [Host("a", cpu(2000, 1000),
                                                           attributes={"zone": "eu"})])
    assert result.pending_reasons[("j", 0)] == "no worker matches constraints: pool EQ tpu"


def test_a_gang_takes_the_group_its_preferences_like_best() -> None:
    hosts = [Host(f"{s}{i}", SLICE_HOST, attributes={"slice": s, "zone": z})
             for s, z in (("a", "us"), ("b", "eu")) for i in range(2)]
    gang = task("g", 0, 1, gang=Coscheduling(group_by="slice"), constraints=PREFER_EU)
    assert {a.group for a in place([gang], hosts).assignments} == {"slice=b"}
    plain = task("g", 0, 1, gang=Coscheduling(group_by="slice"))
    assert {a.group for a in place([plain], hosts).assignments} == {"slice=a"}


def test_out_of_service_hosts_take_nothing_and_the_reason_says_why() -> None:
    hosts = [Host("a", cpu(4000, 1000), out_of_service="cordoned: disk swap"),
             Host("b", cpu(4000, 1000), out_of_service="quarantined: 3 failures of 2 jobs")]
    result = place([task("j", 0)], hosts)
    assert result.assignments == []
    assert result.pending_reasons[("j", 0)] == (
        "every matching worker is out of service: a cordoned: disk swap; "
        "b quarantined: 3 failures of 2 jobs")
    slice_hosts = [Host(f"s{i}", SLICE_HOST, attributes={"slice": "s"},
                        out_of_service="draining" if i == 0 else "") for i in range(2)]
    gang = task("g", 0, 1, gang=Coscheduling(group_by="slice"))
    assert place([gang], slice_hosts).pending_reasons[("g", 0)] == (
        "no slice group can take all 2 tasks: slice=s has 1 matching workers, needs 2 "
        "(out of service: s0 draining)")


def least_need(units: list[Unit]) -> Amounts:
    return Amounts(min(u.need.cpu for u in units), min(u.need.mem for u in units),
                   min(u.need.disk for u in units), min(u.need.dev for u in units))


# Needs of a few sizes, so that capacity runs out mid-walk often; some gangs.
tasks_drawn = st.lists(st.tuples(st.sampled_from([0, 250, 500, 1000, 2000]),
                                 st.sampled_from([1, 100, 1000]), st.integers(0, 2),
                                 st.sampled_from(["", "a", "b"]), st.integers(1, 3),
                                 st.booleans()), min_size=1, max_size=40)


def drawn_units(tasks: list[tuple[int, int, int, str, int, bool]]) -> list[Unit]:
    """Singles and gangs of drawn needs, some confined to a pool (by constraint or group)."""
    return [Unit(f"t{i}", tuple(range(n)), Amounts(c, m, 0, d), "gpu:x" if d else "",
                 (Constraint(key="pool", op=Op.EQ, value=pool),) if pool else (), (),
                 Coscheduling(group_by="pool") if gang and n > 1 else None)
            for i, (c, m, d, pool, n, gang) in enumerate(tasks)]


@settings(max_examples=300, deadline=None)
@given(
    # Needs and capacities of a few sizes, so that capacity runs out mid-walk often.
    tasks_drawn,
    st.lists(st.tuples(st.sampled_from([0, 500, 1000, 2000, 4000]),
                       st.sampled_from([0, 1000, 4000]), st.integers(0, 4),
                       st.sampled_from(["a", "b"]), st.booleans()), max_size=12),
    st.integers(1, 50),
)
def test_stopping_once_capacity_runs_out_places_exactly_what_the_full_walk_places(
        tasks: list[tuple[int, int, int, str, int, bool]],
        hosts: list[tuple[int, int, int, str, bool]], limit: int) -> None:
    """`stop_below` (the least need of every unit) changes which units are examined, never
    which are placed: the stopped walk's assignments are the full walk's, its reasons are
    the full walk's for the units it examined, and it stops only where the full walk
    places nothing more."""
    units = drawn_units(tasks)
    caps = [Host(f"h{i:02d}", Amounts(c, m, 0, d), "gpu:x" if d else "", {"pool": pool},
                 out_of_service="cordoned" if away else "")
            for i, (c, m, d, pool, away) in enumerate(hosts)]
    full = place(units, caps, limit=limit)
    stopped = place(units, caps, limit=limit, stop_below=least_need(units))
    assert stopped.assignments == full.assignments
    assert stopped.groups == full.groups
    assert stopped.truncated == full.truncated or stopped.exhausted
    for key, reason in stopped.pending_reasons.items():
        assert full.pending_reasons[key] == reason
    if stopped.exhausted:
        assert not full.truncated or len(full.assignments) >= limit
        assert len(stopped.pending_reasons) <= len(full.pending_reasons)


def test_a_full_cluster_stops_the_walk_at_the_first_unit_that_cannot_fit() -> None:
    hosts = [Host("a", cpu(2000, 1000)), Host("b", cpu(1000, 1000))]
    units = [task(f"j{i}", 0) for i in range(1000)]
    result = place(units, hosts, stop_below=ONE_CORE)
    assert [a.job_id for a in result.assignments] == ["j0", "j1", "j2"]
    assert result.exhausted and not result.pending_reasons  # j3 on were never examined
    walked = place(units, hosts)
    assert walked.assignments == result.assignments and len(walked.pending_reasons) == 997


@settings(max_examples=300, deadline=None)
@given(
    tasks_drawn,
    st.lists(st.tuples(st.sampled_from([0, 500, 1000, 2000, 4000]),
                       st.sampled_from([0, 1000, 4000]), st.integers(0, 4),
                       st.sampled_from(["a", "b"]), st.booleans(),
                       st.sampled_from([None, None, None, "t0", "t1"]),
                       st.sampled_from([None, "reversed", "short"])), max_size=12),
    st.integers(1, 50), st.booleans(), st.sampled_from([1, 2, 16]),
)
def test_placing_from_a_host_index_places_exactly_what_a_pass_over_the_hosts_does(
        tasks: list[tuple[int, int, int, str, int, bool]],
        hosts: list[tuple[int, int, int, str, bool, str | None, str | None]], limit: int,
        stop: bool, first_pull: int) -> None:
    """The scheduler keeps its hosts in a HostIndex between ticks, and the common shape's
    heap is filled from its ranking only as far as a call reads: the same assignments,
    groups and reasons as a call given the hosts alone, over held hosts, hosts out of
    service, gangs taking from hosts the ranking has not reached, and devices listed out
    of order or fewer than counted. The index is as it was after the call."""
    units = drawn_units(tasks)

    def devices(count: int, listed: str | None) -> list[int] | None:
        if listed is None:
            return None
        return list(range(count))[::-1] if listed == "reversed" else list(range(count - 1))

    def made() -> list[Host]:
        return [Host(f"h{i:02d}", Amounts(c, m, 0, d), "gpu:x" if d else "", {"pool": pool},
                     out_of_service="cordoned" if away else "", held_for=held,
                     free_devices=devices(d, listed))
                for i, (c, m, d, pool, away, held, listed) in enumerate(hosts)]

    stop_below = least_need(units) if stop else None
    alone = place(units, made(), limit=limit, stop_below=stop_below)
    index = HostIndex()
    for host in made():
        index.put(host)
    before = as_given(index.listed())
    # Drawn clusters are smaller than the first pull from the ranking: smaller pulls make
    # each call read it part way, as a tick among 1,000 hosts does.
    default, placement.FIRST_PULL = placement.FIRST_PULL, first_pull
    try:
        indexed = place(units, index.listed(), limit=limit, stop_below=stop_below,
                        index=index)
    finally:
        placement.FIRST_PULL = default
    assert indexed.assignments == alone.assignments
    assert indexed.groups == alone.groups
    assert indexed.pending_reasons == alone.pending_reasons
    assert (indexed.truncated, indexed.exhausted) == (alone.truncated, alone.exhausted)
    assert as_given(index.listed()) == before
