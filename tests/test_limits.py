"""Quotas and tokens (docs/placement.md "Quotas", docs/lifecycle.md "Tokens"): the pure
admission rule (tables and properties), placement honouring it (a gang whole or not at
all), the fold judging every admission, and the Lua commit enforcing it on a real valkey."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.scheduler import placement
from berth.shared import limits as rules
from berth.shared import redis_auth, redis_io, subjects
from berth.shared.capacity import Amounts
from berth.shared.checker import miscounted_limit_use
from berth.shared.event_origin import RefusedEvent, read_event
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    Coscheduling,
    JobCancelRequested,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    Quota,
    QuotaSet,
    Resources,
    TaskAssigned,
    TokenLimitSet,
    WorkerDeclaredDead,
    WorkerRegistered,
    encode,
    job_spec_decoder,
)
from berth.shared.reservations import Reservation, ReservationConflict, ReservationStore

CPU2 = Amounts(cpu=2000, mem=100)
NO_QUOTA = Quota()


def limits(default: Quota = NO_QUOTA, tokens: dict[str, int] | None = None,
           **quotas: Quota) -> rules.Limits:
    return rules.Limits(default=default, quotas=dict(quotas), tokens=tokens or {})


# --- the pure rule ------------------------------------------------------------------------


@pytest.mark.parametrize(("lim", "used", "user", "need", "tokens", "count", "want"), [
    # No limits: everything goes.
    (limits(), {}, "ann", CPU2, {}, 5, None),
    # The default applies to every user; a whole unit must fit.
    (limits(Quota(cpu=8000)), {"ann": Amounts(cpu=6000)}, "ann", CPU2, {}, 1, None),
    (limits(Quota(cpu=8000)), {"ann": Amounts(cpu=8000)}, "ann", CPU2, {}, 1,
     "user quota ann: cpu 8/8 cores in use, needs 2 more"),
    (limits(Quota(cpu=8000)), {"ann": Amounts(cpu=4000)}, "ann", CPU2, {}, 3,
     "user quota ann: cpu 4/8 cores in use, needs 6 more"),
    # A user's own quota wins, one dimension at a time.
    (limits(Quota(cpu=2000, mem=50), ann=Quota(cpu=8000)), {}, "ann", CPU2, {}, 1,
     "user quota ann: memory 0/50 MiB in use, needs 100 more"),
    (limits(Quota(cpu=2000), bob=Quota(cpu=8000)), {"bob": Amounts(cpu=4000)}, "bob", CPU2,
     {}, 1, None),
    # Devices; a dimension the unit does not ask for never holds it back.
    (limits(Quota(dev=1)), {"ann": Amounts(dev=1)}, "ann", Amounts(cpu=1, dev=1), {}, 1,
     "user quota ann: devices 1/1 in use, needs 1 more"),
    (limits(Quota(dev=0)), {}, "ann", CPU2, {}, 1, None),
    # Tokens: held per task, a unit's tasks all at once.
    (limits(tokens={"io": 4}), {}, "ann", CPU2, {"io": 1}, 4, None),
    (limits(tokens={"io": 4}), {}, "ann", CPU2, {"io": 1}, 5,
     "waiting for token io (0/4 in use)"),
    (limits(tokens={"io": 2}), {}, "ann", CPU2, {"nope": 1}, 1,
     "waiting for token nope (no such token: `berth tokens set nope N`)"),
])
def test_refusal_table(lim: rules.Limits, used: dict[str, Amounts], user: str, need: Amounts,
                       tokens: dict[str, int], count: int, want: str | None) -> None:
    assert rules.refusal(lim, rules.Usage(dict(used)), user, need, tokens, count) == want


def test_a_lowered_limit_stops_nothing_and_admits_nothing_until_under() -> None:
    usage = rules.Usage()
    lim = limits(tokens={"io": 3})
    for _ in range(3):
        assert rules.refusal(lim, usage, "ann", CPU2, {"io": 1}) is None
        rules.take(usage, "ann", CPU2, {"io": 1})
    rules.apply_token_limit(lim, "io", 1, seq=7)
    assert rules.refusal(lim, usage, "ann", CPU2, {"io": 1}) == "waiting for token io (3/1 in use)"
    rules.give_back(usage, "ann", CPU2, {"io": 1})
    rules.give_back(usage, "ann", CPU2, {"io": 1})
    assert rules.refusal(lim, usage, "ann", CPU2, {"io": 1}) == "waiting for token io (1/1 in use)"
    rules.give_back(usage, "ann", CPU2, {"io": 1})
    assert rules.refusal(lim, usage, "ann", CPU2, {"io": 1}) is None
    assert usage == rules.Usage()  # nothing left behind


@settings(max_examples=80, deadline=None)
@given(
    cpu_limit=st.integers(0, 10), token_limit=st.integers(0, 6),
    steps=st.lists(st.tuples(st.sampled_from(["ann", "bob"]), st.integers(1, 3),
                             st.integers(1, 4), st.booleans(), st.integers(0, 99)),
                   max_size=60),
)
def test_random_interleavings_never_exceed_the_limits(
        cpu_limit: int, token_limit: int,
        steps: list[tuple[str, int, int, bool, int]]) -> None:
    """Units (a user, cores per task, tasks, whether they hold a token) are admitted by the
    rule and taken, or some running one ends, in any order: use never goes over."""
    lim = limits(Quota(cpu=cpu_limit * 1000), tokens={"io": token_limit})
    usage = rules.Usage()
    running: list[tuple[str, Amounts, dict[str, int], int]] = []
    for user, cores, count, token, pick in steps:
        if pick % 3 == 0 and running:
            rules.give_back(usage, *running.pop(pick % len(running)))
            continue
        need, toks = Amounts(cpu=cores * 1000, mem=1), {"io": 1} if token else {}
        if rules.refusal(lim, usage, user, need, toks, count) is None:
            rules.take(usage, user, need, toks, count)
            running.append((user, need, toks, count))
        for u, used in usage.users.items():
            assert used.cpu <= cpu_limit * 1000, u
        assert usage.tokens.get("io", 0) <= token_limit
    for item in running:
        rules.give_back(usage, *item)
    assert usage == rules.Usage()


# --- placement ----------------------------------------------------------------------------


def host(name: str, cpu: int = 8000, slice_: str = "s") -> placement.Host:
    return placement.Host(name, Amounts(cpu, 1000, 1000), attributes={"slice": slice_})


def test_placement_admits_within_the_quota_and_says_why_not() -> None:
    lim = limits(Quota(cpu=3000))
    units = [placement.Unit("j1", (0, 1, 2, 3), Amounts(cpu=1000), user="ann"),
             placement.Unit("j2", (0,), Amounts(cpu=1000), user="bob")]
    result = placement.place(units, [host("w1"), host("w2")], limits=(lim, rules.Usage()))
    assert sorted((a.job_id, a.task_index) for a in result.assignments) == [
        ("j1", 0), ("j1", 1), ("j1", 2), ("j2", 0)]
    assert result.pending_reasons == {
        ("j1", 3): "user quota ann: cpu 3/3 cores in use, needs 1 more"}
    assert result.held_by_limits == {"j1"}


def test_a_gang_is_admitted_whole_or_not_at_all() -> None:
    gang = Coscheduling(group_by="slice")
    lim = limits(tokens={"io": 3})
    unit = placement.Unit("g", (0, 1, 2, 3), Amounts(cpu=1000), gang=gang, user="ann",
                          tokens=(("io", 1),))
    hosts = [host(f"w{i}") for i in range(4)]
    result = placement.place([unit], hosts, limits=(lim, rules.Usage()))
    assert result.assignments == []
    assert set(result.pending_reasons.values()) == {"waiting for token io (0/3 in use)"}
    lim.tokens["io"] = 4
    result = placement.place([unit], hosts, limits=(lim, rules.Usage()))
    assert len(result.assignments) == 4


def test_placement_without_limits_is_unchanged() -> None:
    units = [placement.Unit("j", (0, 1), Amounts(cpu=1000), user="ann", tokens=(("io", 1),))]
    assert len(placement.place(units, [host("w1")]).assignments) == 2


# --- the fold and the checker -------------------------------------------------------------


def _fold(limit: int, assigned: int, limits_seq_of: int | None = None) -> ClusterState:
    """A token limit `limit` set at seq 3; `assigned` tasks asking for it assigned."""
    state = ClusterState()
    spec = JobSpec(name="t", command=["true"], replicas=4, user="ann",
                   resources=Resources(cpu=1, memory_mb=10), tokens={"io": 1})
    state.apply(1, LeaderElected(epoch=1, scheduler_id="s"))
    state.apply(2, WorkerRegistered(worker_id="w", incarnation="i",
                                    resources=Resources(cpu=8, memory_mb=1000)))
    state.apply(3, TokenLimitSet(name="io", limit=limit))
    state.apply(4, JobSubmitted(job_id="j1-aaaa", submit_seq=1, spec=spec))
    for i in range(assigned):
        state.apply(5 + i, TaskAssigned(job_id="j1-aaaa", task_index=i, attempt_id=0,
                                        worker_id="w", incarnation="i", epoch=1,
                                        limits_seq=3 if limits_seq_of is None else limits_seq_of))
    return state


def test_the_fold_counts_use_and_flags_an_admission_over_the_limit() -> None:
    within = _fold(2, 2)
    assert within.usage.tokens == {"io": 2}
    assert within.usage.users["ann"] == Amounts(cpu=2000, mem=20)
    assert within.over_limits == []
    over = _fold(2, 3)
    assert over.over_limits == ["j1-aaaa/2/0: token io: 3 in use > limit 2"]


def test_an_assignment_is_judged_by_the_limits_it_was_committed_against() -> None:
    state = _fold(4, 3)
    # Lowered after those commits: what runs is no violation, a commit against it would be.
    state.apply(20, TokenLimitSet(name="io", limit=1))
    assert state.over_limits == []
    state.apply(21, TaskAssigned(job_id="j1-aaaa", task_index=3, attempt_id=0,
                                 worker_id="w", incarnation="i", epoch=1, limits_seq=20))
    assert state.over_limits == ["j1-aaaa/3/0: token io: 4 in use > limit 1"]


def test_a_worker_death_gives_the_use_back_and_a_cancel_only_once_the_exit_is_known() -> None:
    state = _fold(2, 2)
    state.apply(10, JobCancelRequested(job_id="j1-aaaa", submit_seq=2))
    # Killing frees nothing (invariant 3): the token is held until the exit is confirmed.
    assert state.usage.tokens == {"io": 2}
    state.apply(11, WorkerDeclaredDead(worker_id="w", incarnation="i", epoch=1))
    assert state.usage == rules.Usage() and state.over_limits == []


def test_limit_events_are_believed_only_from_their_admin_subjects() -> None:
    quota = encode(QuotaSet(user="ann", quota=Quota(cpu=1000)))
    token = encode(TokenLimitSet(name="io", limit=2))
    assert isinstance(read_event(subjects.ADMIN_QUOTAS, quota), QuotaSet)
    assert isinstance(read_event(subjects.admin_tokens("io"), token), TokenLimitSet)
    for subject in (subjects.PENDING_REASONS, subjects.task_events("j1-aaaa"),
                    subjects.admin_tokens("other")):
        with pytest.raises(RefusedEvent):
            read_event(subject, token)
    with pytest.raises(RefusedEvent):
        read_event(subjects.PENDING_REASONS, quota)


def test_bad_limits_and_token_names_are_refused_naming_the_field() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$\.limit"):
        msgspec.json.decode(b'{"type":"token_limit_set","name":"io","limit":-1}',
                            type=TokenLimitSet)
    with pytest.raises(msgspec.ValidationError, match=r"tokens"):
        msgspec.json.decode(b'{"name":"j","command":["x"],"tokens":{"bad name":1}}',
                            type=JobSpec)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.tokens\[\.\.\.\]"):
        job_spec_decoder.decode(b'{"name":"j","command":["x"],"tokens":{"io":0}}')


def test_snapshot_keeps_limits_and_use() -> None:
    from berth.shared import state_snapshot

    state = _fold(4, 2)
    loaded = state_snapshot.load(state_snapshot.dump(state, "s@1"), "s@1", state.last_seq)
    assert loaded.limits == state.limits and loaded.usage == state.usage
    assert loaded.limit_versions == state.limit_versions


# --- the Lua commit on a real valkey ------------------------------------------------------


@pytest.fixture
async def store(clean_servers) -> AsyncIterator[ReservationStore]:  # type: ignore[no-untyped-def]
    client = redis_io.connect(clean_servers[1].url_for(redis_auth.SCHEDULER))
    yield ReservationStore(client)
    await client.aclose()


def res(key: str, user: str = "ann", cpu: int = 1000, tokens: tuple[tuple[str, int], ...] = (),
        worker: str = "h1") -> Reservation:
    return Reservation(worker, key, key.split("/")[0], Amounts(cpu, 10), user=user,
                       tokens=tokens)


async def test_the_commit_checks_and_takes_quotas_and_tokens(store: ReservationStore) -> None:
    epoch = await store.acquire_lease("a", 60_000)
    for w in ("h1", "h2"):
        await store.register_host(epoch, w, Amounts(8000, 1000, 1000), "")
    lim = limits(Quota(cpu=2000), tokens={"io": 2}, bob=Quota(cpu=4000))
    await store.set_limits(epoch, rules.redis_fields(lim))
    io = (("io", 1),)
    # A gang of three over ann's quota: none of it is written.
    with pytest.raises(ReservationConflict, match="user quota ann: cpu 0 \\+ 3000 over 2000"):
        await store.reserve(epoch, [res(f"g/{i}/0", worker=f"h{i % 2 + 1}") for i in range(3)])
    await store.reserve(epoch, [res("a/0/0", tokens=io), res("b/0/0", "bob", tokens=io)])
    with pytest.raises(ReservationConflict, match="token io: 2 \\+ 1 over 2"):
        await store.reserve(epoch, [res("b/1/0", "bob", tokens=io)])
    await store.reserve(epoch, [res("b/1/0", "bob"), res("b/2/0", "bob")])
    snapshot = await store.snapshot()
    assert snapshot.limits_used == {"cpu:ann": "1000", "mem:ann": "10", "cpu:bob": "3000",
                                    "mem:bob": "30", "t:io": "2"}
    assert miscounted_limit_use(snapshot.hosts, snapshot.limits_used) == []
    # Releasing gives back; re-reserving what runs ignores a lowered limit.
    assert await store.release(epoch, [("h1", "a/0/0"), ("h1", "b/0/0")]) == 2
    assert (await store.snapshot()).limits_used == {"cpu:bob": "2000", "mem:bob": "20"}
    await store.set_limits(epoch, rules.redis_fields(limits(Quota(cpu=0), tokens={"io": 0})))
    with pytest.raises(ReservationConflict, match="user quota"):
        await store.reserve(epoch, [res("a/1/0")])
    await store.reserve(epoch, [res("a/0/0", tokens=io)], check_limits=False)
    snapshot = await store.snapshot()
    assert snapshot.limits_used["t:io"] == "1"
    assert miscounted_limit_use(snapshot.hosts, snapshot.limits_used) == []
    with pytest.raises(ReservationConflict, match="no token other"):
        await store.set_limits(epoch, rules.redis_fields(limits()))
        await store.reserve(epoch, [res("c/0/0", tokens=(("other", 1),))])


async def test_releases_in_one_call_give_back_what_each_held(store: ReservationStore) -> None:
    """release.lua sums what a call gives back per host and per counter and writes each
    once: whatever mix of attempts (several on one host, of several users, with tokens,
    released twice, never reserved) goes in one call, each host's use and each counter
    still equal the sums of the reservations left, and a counter at 0 is gone."""
    import random

    rng = random.Random(18)
    epoch = await store.acquire_lease("a", 60_000)
    hosts = ("h1", "h2", "h3")
    for w in hosts:
        await store.register_host(epoch, w, Amounts(64000, 64000, 0), "")
    await store.set_limits(epoch, rules.redis_fields(limits(tokens={"io": 999, "gpu-lic": 99})))
    held: list[tuple[str, str]] = []
    for n in range(40):
        commit = [res(f"j{n}/{k}/0", rng.choice(["ann", "bob", ""]), rng.choice([500, 1000]),
                      rng.choice([(), (("io", 1),), (("io", 2), ("gpu-lic", 1))]),
                      rng.choice(hosts))
                  for k in range(rng.randint(1, 4))]
        await store.reserve(epoch, commit)
        held += [(r.worker_id, r.attempt_key) for r in commit]
        rng.shuffle(held)
        cut = rng.randint(0, len(held))
        gone, held = held[:cut], held[cut:]
        batch = gone + gone[:1] + [("h1", f"never/{n}/0")]  # a repeat, and one never held
        assert await store.release(epoch, batch) == len(gone)
        snapshot = await store.snapshot()
        assert miscounted_limit_use(snapshot.hosts, snapshot.limits_used) == []
        assert all(int(v) for v in snapshot.limits_used.values())  # none left at 0
        for h in snapshot.hosts:
            assert h.used == sum((a.need for a in h.allocations.values()), Amounts())
        assert sum(len(h.allocations) for h in snapshot.hosts) == len(held)
    await store.release(epoch, held)
    snapshot = await store.snapshot()
    assert snapshot.limits_used == {}
    assert all(h.used == Amounts() for h in snapshot.hosts)


# --- the CLI's bad input: one line naming the field, nothing published ----------------------


@pytest.mark.parametrize(("args", "line"), [
    (["quota", "set", "ann", "--cpu", "-1"],
     "berth: --cpu: -1 is not a limit (a number, 0 or more)"),
    (["quota", "set", "ann", "--memory-mb", "-5"],
     "berth: --memory-mb: -5 is not a limit (a number, 0 or more)"),
    (["quota", "set", "a.b", "--cpu", "1"],
     "berth: USER: 'a.b' is not a user name (1-128 letters, digits, '-' and '_'), nor '*' "
     "for the default"),
    (["tokens", "set", "bad name", "2"],
     "berth: NAME: 'bad name' is not a token name (1-63 letters, digits, '-' and '_', "
     "starting with a letter or digit)"),
    (["tokens", "set", "io", "--", "-1"], "berth: LIMIT: -1 is not a limit (0 or more)"),
])
def test_bad_cli_input_is_one_line_naming_the_field(
        args: list[str], line: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from berth import cli

    where = ["--data-dir", str(tmp_path), "--nats-url", "nats://127.0.0.1:1"]
    assert cli.main([*where, *args]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [line]
