"""The Lua scripts against a real Redis-compatible server: atomic, all-or-nothing, fenced;
capacity in every dimension, device kinds, ports and gang groups re-checked at commit."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from msgspec.structs import replace

from berth.shared import redis_auth, redis_io, servers
from berth.shared.capacity import Amounts, GroupClaim
from berth.shared.reservations import (
    REGISTER_BATCH,
    Eviction,
    HostRecord,
    Reservation,
    ReservationConflict,
    ReservationStore,
    StaleEpochError,
)

HOST = Amounts(cpu=2000, mem=1000, disk=500, dev=4)


def res(host: str, key: str, cpu: int = 1000, mem: int = 100, dev: int = 0,
        ports: tuple[int, ...] = (), group: str = "", kind: str = "") -> Reservation:
    return Reservation(host, key, key.split("/")[0], Amounts(cpu, mem, 0, dev), kind, ports,
                       group)


@pytest.fixture
async def store(clean_servers) -> AsyncIterator[ReservationStore]:
    # As the scheduler, the only writer: its ACL user must be enough for every script.
    client = redis_io.connect(clean_servers[1].url_for(redis_auth.SCHEDULER))
    yield ReservationStore(client)
    await client.aclose()


async def leader_with_hosts(store: ReservationStore, *hosts: str, kind: str = "") -> int:
    epoch = await store.acquire_lease("a", 60_000)
    for host in hosts:
        await store.register_host(epoch, host, HOST, kind)
    return epoch


async def test_lease_gives_increasing_epochs_and_one_holder(store: ReservationStore) -> None:
    first = await store.acquire_lease("a", 60_000)
    assert first >= 1
    assert await store.acquire_lease("a", 60_000) == first  # renewal keeps the epoch
    assert await store.acquire_lease("b", 60_000) == 0  # held by a
    await store.client.delete("berth:leader")  # the lease expires
    second = await store.acquire_lease("b", 60_000)
    assert second == first + 1


async def test_reserve_is_all_or_nothing(store: ReservationStore) -> None:
    epoch = await leader_with_hosts(store, "h1", "h2")
    with pytest.raises(ReservationConflict, match="over capacity on h2"):
        await store.reserve(epoch, [res("h1", "j/0/0"), res("h2", "j/1/0", 1200),
                                    res("h2", "j/2/0", 1200)])
    usage = {u.worker_id: u for u in await store.host_usage()}
    assert usage["h1"].used == Amounts() and usage["h1"].allocations == {}
    await store.reserve(epoch, [res("h1", "j/0/0"), res("h2", "j/1/0")])
    with pytest.raises(ReservationConflict, match="already reserved"):
        await store.reserve(epoch, [res("h1", "j/0/0", 1, 1)])
    with pytest.raises(ReservationConflict, match="unknown host"):
        await store.reserve(epoch, [res("nope", "j/9/0", 1, 1)])


async def test_devices_must_match_kind_and_count(store: ReservationStore) -> None:
    epoch = await leader_with_hosts(store, "t1", kind="tpu:v5p:2x2x1")
    with pytest.raises(ReservationConflict, match="no device gpu:h100"):
        await store.reserve(epoch, [res("t1", "g/0/0", dev=1, kind="gpu:h100")])
    await store.reserve(epoch, [res("t1", "a/0/0", dev=3, kind="tpu:v5p:2x2x1")])
    with pytest.raises(ReservationConflict, match=r"over capacity on t1 \(dev\)"):
        await store.reserve(epoch, [res("t1", "b/0/0", dev=2, kind="tpu:v5p:2x2x1")])


async def test_a_port_is_never_given_twice_on_one_host(store: ReservationStore) -> None:
    epoch = await leader_with_hosts(store, "h1", "h2")
    with pytest.raises(ReservationConflict, match="port 30000 of h1's address is taken"):
        await store.reserve(epoch, [res("h1", "a/0/0", 10, ports=(30000,)),
                                    res("h1", "b/0/0", 10, ports=(30000,))])
    await store.reserve(epoch, [res("h1", "a/0/0", 10, ports=(30000,)),
                                res("h2", "b/0/0", 10, ports=(30000,))])  # other host: fine
    with pytest.raises(ReservationConflict, match="port 30000 of h1's address is taken"):
        await store.reserve(epoch, [res("h1", "c/0/0", 10, ports=(30000,))])
    await store.release(epoch, [("h1", "a/0/0")])
    await store.reserve(epoch, [res("h1", "c/0/0", 10, ports=(30000,))])
    (h1, _) = await store.host_usage()
    assert {k: a.ports for k, a in h1.allocations.items()} == {"c/0/0": (30000,)}


async def test_workers_sharing_an_address_share_its_ports(store: ReservationStore) -> None:
    """Ports belong to the address: two workers on 127.0.0.1 never get the same port, in
    one commit or across commits, and a released port is free for either."""
    epoch = await leader_with_hosts(store, "w1", "w2", "w3")

    def on(worker: str, key: str, address: str = "127.0.0.1") -> Reservation:
        return replace(res(worker, key, 10, ports=(30000,)), address=address)

    with pytest.raises(ReservationConflict, match="port 30000 of w2's address is taken"):
        await store.reserve(epoch, [on("w1", "a/0/0"), on("w2", "b/0/0")])
    await store.reserve(epoch, [on("w1", "a/0/0"), on("w3", "b/0/0", "10.0.0.3")])
    with pytest.raises(ReservationConflict, match="port 30000 of w2's address is taken"):
        await store.reserve(epoch, [on("w2", "c/0/0")])
    await store.release(epoch, [("w1", "a/0/0")])
    await store.reserve(epoch, [on("w2", "c/0/0")])
    hosts, _ = await store.usage()
    held = {k: (a.address, a.ports) for h in hosts for k, a in h.allocations.items()}
    assert held == {"b/0/0": ("10.0.0.3", (30000,)), "c/0/0": ("127.0.0.1", (30000,))}


async def test_a_group_is_held_by_one_gang_until_its_last_attempt_is_released(
        store: ReservationStore) -> None:
    epoch = await leader_with_hosts(store, "s0", "s1", "s2")
    slice_a = ("s0", "s1", "s2")
    gang_a = [res(h, f"ga/{i}/0", group="tpu-name=a") for i, h in enumerate(slice_a[:2])]
    await store.reserve(epoch, gang_a, [GroupClaim("tpu-name=a", "ga", slice_a)])
    # Another gang on any host of the group, even one the first gang does not use: refused.
    with pytest.raises(ReservationConflict, match="group tpu-name=a is held by ga"):
        await store.reserve(epoch, [res("s2", "gb/0/0", group="tpu-name=a")],
                            [GroupClaim("tpu-name=a", "gb", slice_a)])
    with pytest.raises(ReservationConflict, match="host s2 is held by gang ga"):
        await store.reserve(epoch, [res("s2", "gb/0/0", group="zone=z")],
                            [GroupClaim("zone=z", "gb", ("s2",))])
    # The same gang re-placed while its old attempts still hold the group: allowed.
    await store.reserve(epoch, [res("s2", "ga/0/1", 500, group="tpu-name=a")],
                        [GroupClaim("tpu-name=a", "ga", slice_a)])
    (group,) = await store.group_usage()
    assert (group.owner, group.members, group.live) == ("ga", slice_a, 3)
    await store.release(epoch, [("s0", "ga/0/0"), ("s1", "ga/1/0")])
    assert (await store.group_usage())[0].live == 1
    await store.release(epoch, [("s2", "ga/0/1")])
    assert await store.group_usage() == []
    assert all(u.gang is None for u in await store.host_usage())
    await store.reserve(epoch, [res("s2", "gb/0/0", group="tpu-name=a")],
                        [GroupClaim("tpu-name=a", "gb", slice_a)])


async def test_release_is_idempotent(store: ReservationStore) -> None:
    epoch = await leader_with_hosts(store, "h1")
    await store.reserve(epoch, [res("h1", "j/0/0", 1500)])
    assert await store.release(epoch, [("h1", "j/0/0")]) == 1
    assert await store.release(epoch, [("h1", "j/0/0")]) == 0
    (usage,) = await store.host_usage()
    assert (usage.used, usage.allocations) == (Amounts(), {})


async def test_released_through_is_recorded_with_releases_and_only_rises(
        store: ReservationStore) -> None:
    """RELEASED_THROUGH tells the checker how far the leader's releases have gone: written
    in the release's own script (and a commit's), never lowered, never by a deposed
    leader, and not by a release that says nothing (0)."""
    epoch = await leader_with_hosts(store, "h1")
    await store.reserve(epoch, [res("h1", f"j/{n}/0", 100) for n in range(5)])
    assert (await store.snapshot()).released_through == 0
    await store.release(epoch, [("h1", "j/0/0")], 40)
    assert (await store.snapshot()).released_through == 40
    await store.release(epoch, [("h1", "j/1/0")], 30)  # a stale claim: kept at 40
    await store.release(epoch, [("h1", "j/2/0")])
    assert (await store.snapshot()).released_through == 40
    await store.reserve(epoch, [res("h1", "k/0/0", 100)], releases=[("h1", "j/3/0")],
                        released_through=55)
    snapshot = await store.snapshot()
    assert snapshot.released_through == 55
    assert sorted(snapshot.hosts[0].allocations) == ["j/4/0", "k/0/0"]
    await store.client.delete("berth:leader")
    new = await store.acquire_lease("b", 60_000)
    with pytest.raises(StaleEpochError):
        await store.release(epoch, [("h1", "j/4/0")], 90)
    assert (await store.snapshot()).released_through == 55
    await store.release(new, [("h1", "j/4/0")], 60)
    assert (await store.snapshot()).released_through == 60


async def test_a_deposed_leader_cannot_write(store: ReservationStore) -> None:
    old = await leader_with_hosts(store, "h1")
    await store.client.delete("berth:leader")
    new = await store.acquire_lease("b", 60_000)
    assert new > old
    with pytest.raises(StaleEpochError):
        await store.reserve(old, [res("h1", "j/0/0")])
    with pytest.raises(StaleEpochError):
        await store.release(old, [("h1", "j/0/0")])
    with pytest.raises(StaleEpochError):
        await store.register_host(old, "h1", Amounts(99999, 99999), "")
    (usage,) = await store.host_usage()
    assert usage.capacity == HOST and usage.allocations == {}


async def test_devices_are_pinned_in_the_commit_and_freed_by_release(
        store: ReservationStore) -> None:
    epoch = await store.acquire_lease("a", 60_000)
    await store.register_host(epoch, "g1", HOST, "gpu:h100", [0, 1, 2, 3])

    def pin(key: str, *devices: int) -> Reservation:
        return replace(res("g1", key, 10, dev=len(devices), kind="gpu:h100"), devices=devices)

    await store.reserve(epoch, [pin("a/0/0", 0), pin("b/0/0", 2, 3)])
    with pytest.raises(ReservationConflict, match="device 1 of g1 is taken"):
        await store.reserve(epoch, [pin("c/0/0", 1), pin("d/0/0", 1)])  # twice in one commit
    with pytest.raises(ReservationConflict, match="device 3 of g1 is taken"):
        await store.reserve(epoch, [pin("c/0/0", 3)])
    with pytest.raises(ReservationConflict, match="host g1 has no device 7"):
        await store.reserve(epoch, [pin("c/0/0", 7)])
    with pytest.raises(ReservationConflict, match="names 1 devices for 2"):
        await store.reserve(epoch, [replace(pin("c/0/0", 1), need=Amounts(10, 100, 0, 2))])
    (g1,) = await store.host_usage()
    assert {k: a.devices for k, a in g1.allocations.items()} == {"a/0/0": (0,),
                                                                 "b/0/0": (2, 3)}
    await store.release(epoch, [("g1", "b/0/0")])
    await store.reserve(epoch, [pin("c/0/0", 3)])
    assert await store.client.hgetall("berth:hostdevs:g1") == {"0": "a/0/0", "3": "c/0/0"}


async def test_random_commits_and_releases_never_give_a_device_twice(
        store: ReservationStore) -> None:
    """Commits naming random devices (free, taken, repeated within a commit, unknown) and
    random releases: whatever Redis accepts, no device is held by two reservations, the
    device hash agrees with them, and a refused commit changes nothing."""
    import random

    rng = random.Random(20)
    epoch = await store.acquire_lease("a", 60_000)
    for host in ("g1", "g2"):
        await store.register_host(epoch, host, Amounts(64000, 64000, 0, 4), "gpu:h100",
                                  [0, 1, 2, 3])
    held: list[tuple[str, str]] = []
    refused = 0
    for n in range(60):
        commit = []
        for k in range(rng.randint(1, 3)):
            host = rng.choice(["g1", "g2"])
            devices = tuple(rng.choice([0, 1, 2, 3, 3, 5]) for _ in range(rng.randint(1, 2)))
            commit.append(replace(res(host, f"j{n}/{k}/0", 10, 1, len(devices), kind="gpu:h100"),
                                  devices=devices))
        before = await store.usage()
        try:
            await store.reserve(epoch, commit)
        except ReservationConflict:
            refused += 1
            assert await store.usage() == before  # all or nothing
        else:
            held += [(r.worker_id, r.attempt_key) for r in commit]
        if held and rng.random() < 0.4:
            await store.release(epoch, [held.pop(rng.randrange(len(held)))])
        hosts, _ = await store.usage()
        for h in hosts:
            taken = [d for a in h.allocations.values() for d in a.devices]
            assert len(taken) == len(set(taken)) and set(taken) <= {0, 1, 2, 3}
            in_hash = await store.client.hgetall(f"berth:hostdevs:{h.worker_id}")
            assert in_hash == {str(d): key for key, a in h.allocations.items()
                               for d in a.devices}
            assert h.used.dev == len(taken)
    assert held and refused  # both kinds of commit were tried


async def test_preemption_evicts_and_holds_in_one_fenced_commit(store: ReservationStore) -> None:
    """preempt.lua: the victims must still be reserved and free enough; the held hosts take
    no one but the preemptor (whose reservation clears the hold) until it lets go."""
    epoch = await leader_with_hosts(store, "h1", "h2")
    await store.reserve(epoch, [res("h1", "b/0/0", 2000), res("h2", "c/0/0", 2000)])
    need = {"h1": Amounts(2000, 100)}
    with pytest.raises(ReservationConflict, match="victim gone/0/0 is not reserved on h1"):
        await store.preempt(epoch, Eviction("p", ("h1",), (("h1", "gone/0/0"),), need))
    with pytest.raises(ReservationConflict, match=r"does not free enough on h1 \(cpu\)"):
        await store.preempt(epoch, Eviction("p", ("h1",), (("h1", "b/0/0"),),
                                            {"h1": Amounts(2500, 100)}))
    with pytest.raises(StaleEpochError):
        await store.preempt(epoch + 1, Eviction("p", ("h1",), (("h1", "b/0/0"),), need))
    assert await store.preempt(epoch, Eviction("p", ("h1",), (("h1", "b/0/0"),), need)) == 1
    usage = {u.worker_id: u for u in await store.host_usage()}
    assert usage["h1"].held_for == "p" and "b/0/0" in usage["h1"].allocations  # still held
    with pytest.raises(ReservationConflict, match="h1 is held for preemptor p"):
        await store.preempt(epoch, Eviction("q", ("h1",), (("h1", "b/0/0"),), need))
    await store.release(epoch, [("h1", "b/0/0")])  # the victim's exit
    with pytest.raises(ReservationConflict, match="host h1 is held for preemptor p"):
        await store.reserve(epoch, [res("h1", "third/0/0")])
    await store.reserve(epoch, [res("h1", "p/0/0", 2000)])
    assert {u.worker_id: u for u in await store.host_usage()}["h1"].held_for is None
    # Letting go: only the preemptor's own holds.
    await store.preempt(epoch, Eviction("q", ("h2",), (("h2", "c/0/0"),),
                                        {"h2": Amounts(2000, 100)}))
    assert await store.unhold(epoch, "other", ["h2"]) == 0
    assert await store.unhold(epoch, "q", ["h2"]) == 1
    assert {u.worker_id: u for u in await store.host_usage()}["h2"].held_for is None


async def test_a_ticks_evictions_go_in_one_call_each_all_or_nothing(
        store: ReservationStore) -> None:
    """preempt_many: one fenced call; an eviction that fails a check writes nothing, the
    others are committed, and each sees the holds of those before it."""
    epoch = await leader_with_hosts(store, "h1", "h2", "h3")
    await store.reserve(epoch, [res("h1", "b/0/0", 2000), res("h2", "c/0/0", 2000),
                                res("h3", "d/0/0", 2000)])

    def evict(job: str, host: str, victim: str) -> Eviction:
        return Eviction(job, (host,), ((host, victim),), {host: Amounts(2000, 100)})

    refusals = await store.preempt_many(epoch, [
        evict("p", "h1", "b/0/0"),
        evict("q", "h2", "gone/0/0"),  # refused: writes nothing
        evict("r", "h1", "b/0/0"),  # refused: h1 is now held for p
        evict("s", "h3", "d/0/0")])
    assert refusals == ["", "victim gone/0/0 is not reserved on h2",
                        "host h1 is held for preemptor p", ""]
    held = {u.worker_id: u.held_for for u in await store.host_usage()}
    assert held == {"h1": "p", "h2": None, "h3": "s"}
    with pytest.raises(StaleEpochError):
        await store.preempt_many(epoch + 1, [evict("q", "h2", "c/0/0")])
    assert {u.worker_id: u.held_for for u in await store.host_usage()}["h2"] is None


async def test_a_gang_holding_a_held_host_is_evicted_whole(store: ReservationStore) -> None:
    epoch = await leader_with_hosts(store, "s0", "s1")
    claim = GroupClaim("slice=s", "g", ("s0", "s1"))
    await store.reserve(epoch, [res("s0", "g/0/0", 2000, group="slice=s"),
                                res("s1", "g/1/0", 2000, group="slice=s")], [claim])
    needs = {"s0": Amounts(2000, 100), "s1": Amounts(2000, 100)}
    with pytest.raises(ReservationConflict, match="gang g would keep g/1/0"):
        await store.preempt(epoch, Eviction("p", ("s0", "s1"), (("s0", "g/0/0"),), needs))
    assert await store.preempt(epoch, Eviction(
        "p", ("s0", "s1"), (("s0", "g/0/0"), ("s1", "g/1/0")), needs)) == 2


async def test_many_hosts_are_registered_in_batches_and_fenced(store: ReservationStore) -> None:
    epoch = await store.acquire_lease("a", 60_000)
    count = REGISTER_BATCH * 2 + 3  # three pipelines, the last a short one
    gpu = [HostRecord(f"g{i}", HOST, "gpu:h100", (0, 2)) for i in range(3)]
    plain = [HostRecord(f"h{i}", HOST, "") for i in range(count - 3)]
    await store.register_hosts(epoch, gpu + plain)
    usage = {u.worker_id: u for u in await store.host_usage()}
    assert len(usage) == count and all(u.capacity == HOST for u in usage.values())
    # Each host's own device list: only the devices it registered can be pinned.
    await store.reserve(epoch, [replace(res("g0", "j/0/0", 10, dev=1, kind="gpu:h100"),
                                        devices=(2,))])
    with pytest.raises(ReservationConflict, match="has no device 1"):
        await store.reserve(epoch, [replace(res("g1", "j/1/0", 10, dev=1, kind="gpu:h100"),
                                            devices=(1,))])
    await store.client.delete("berth:leader")
    assert await store.acquire_lease("b", 60_000) > epoch
    with pytest.raises(StaleEpochError):
        await store.register_hosts(epoch, [HostRecord("late", HOST, "")])
    assert "late" not in {u.worker_id for u in await store.host_usage()}


async def test_releases_go_first_in_the_reserves_round_trip_and_stand_if_it_is_refused(
        store: ReservationStore) -> None:
    epoch = await leader_with_hosts(store, "h1")
    await store.reserve(epoch, [res("h1", "a/0/0", 2000)])  # the host is full
    # The release frees what the placement needs: it is written first.
    await store.reserve(epoch, [res("h1", "b/0/0", 2000)], releases=[("h1", "a/0/0")])
    (usage,) = await store.host_usage()
    assert set(usage.allocations) == {"b/0/0"}
    # A refused placement writes nothing of its own; the releases before it stand.
    with pytest.raises(ReservationConflict, match="over capacity on h1"):
        await store.reserve(epoch, [res("h1", "c/0/0", 2500)], releases=[("h1", "b/0/0")])
    (usage,) = await store.host_usage()
    assert (usage.used, usage.allocations) == (Amounts(), {})
    # Releases alone, as `release` writes them.
    await store.reserve(epoch, [res("h1", "d/0/0", 10)])
    await store.reserve(epoch, [], releases=[("h1", "d/0/0")])
    (usage,) = await store.host_usage()
    assert usage.allocations == {}
    await store.client.delete("berth:leader")
    assert await store.acquire_lease("b", 60_000) > epoch
    with pytest.raises(StaleEpochError):
        await store.reserve(epoch, [res("h1", "e/0/0", 10)], releases=[("h1", "d/0/0")])


async def test_scripts_in_one_pipeline_ask_nothing_first_and_reload_when_forgotten(
        clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
        store: ReservationStore) -> None:
    """One round trip: EVALSHA each, no SCRIPT EXISTS before them (what redis-py's pipeline
    of script objects sends every time). A server that forgot its scripts (restarted, or a
    replica just promoted) gets them loaded, and the refused calls run again, in order."""
    admin = redis_io.connect(clean_servers[1].url_for(redis_auth.ADMIN))
    try:
        epoch = await leader_with_hosts(store, "h1", "h2")
        await store.reserve(epoch, [res("h1", "a/0/0", 2000)])
        await admin.config_resetstat()
        await store.reserve(epoch, [res("h1", "b/0/0", 2000)], releases=[("h1", "a/0/0")])
        stats = await admin.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 2
        assert not any(name.startswith("cmdstat_script") for name in stats)

        # Forgotten, and then only the reserve script loaded again: the release is refused,
        # and the placement, which ran before it, finds h1 full and is refused too. Both
        # run again, in order.
        await admin.script_flush()
        await store.reserve(epoch, [res("h2", "x/0/0", 10)])
        await admin.config_resetstat()
        await store.reserve(epoch, [res("h1", "c/0/0", 2000)], releases=[("h1", "b/0/0")])
        stats = await admin.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 4
        assert stats["cmdstat_script|load"]["calls"] == 1
        assert {u.worker_id: set(u.allocations) for u in await store.host_usage()} == {
            "h1": {"c/0/0"}, "h2": {"x/0/0"}}
        # The batches register_hosts sends (two hosts or more) are pipelines of the same kind.
        await admin.script_flush()
        await admin.config_resetstat()
        await store.register_hosts(epoch, [HostRecord("h3", HOST, ""), HostRecord("h4", HOST, "")])
        stats = await admin.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 4  # both refused, both run again
        assert stats["cmdstat_script|load"]["calls"] == 1
        assert {"h3", "h4"} <= {u.worker_id for u in await store.host_usage()}
    finally:
        await admin.aclose()
