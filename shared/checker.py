"""The placement checker: proves the placement invariants (docs/invariants.md) from Redis
plus the event log, at any moment. `check` is pure (folded state and a Redis read in,
violations out); `check_cluster` does the reading, and is what `berth doctor` and the tests run."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from berth.shared import nats_io
from berth.shared.capacity import Amounts
from berth.shared.lifecycle import ClusterState, Release
from berth.shared.messages import parse_attempt_key
from berth.shared.reservations import GroupUsage, HostUsage, ReservationStore
from berth.shared.states import TaskState

# Violations that must never happen, not even for a moment.
NEVER = ("over_committed", "groups_held_twice", "hosts_shared_by_gangs", "ports_given_twice",
         "devices_given_twice", "taken_from_preemptor", "over_quota", "over_token_limit",
         "limit_use_miscounted", "attempt_keys_reused", "compacted_live")
# Disagreements between Redis and the log: real only when they persist.
PERSISTENT = ("reservations_without_attempt", "attempts_without_reservation")


@dataclass
class Report:
    over_committed: list[str] = field(default_factory=list)
    groups_held_twice: list[str] = field(default_factory=list)
    hosts_shared_by_gangs: list[str] = field(default_factory=list)
    ports_given_twice: list[str] = field(default_factory=list)
    devices_given_twice: list[str] = field(default_factory=list)
    # An attempt placed on a host held for another job's preemption (invariant 9).
    taken_from_preemptor: list[str] = field(default_factory=list)
    # An attempt admitted over its user's quota, or over a token's limit, as they stood in
    # the commit (docs/invariants.md, invariant 12).
    over_quota: list[str] = field(default_factory=list)
    over_token_limit: list[str] = field(default_factory=list)
    # An attempt key the log assigned twice, to different placements (a worker never starts
    # a key it has seen, so the second would never run).
    attempt_keys_reused: list[str] = field(default_factory=list)
    # Redis's quota and token counters disagree with its reservations.
    limit_use_miscounted: list[str] = field(default_factory=list)
    # A job compacted out of the log while an attempt of it was live (docs/retention.md).
    compacted_live: list[str] = field(default_factory=list)
    reservations_without_attempt: list[str] = field(default_factory=list)
    attempts_without_reservation: list[str] = field(default_factory=list)
    # Reservations of attempts the log ended after the leader's RELEASED_THROUGH: releases
    # a leader behind the log still owes, not a leak (capacity held longer, never given
    # twice). Not a violation; counted so an operator sees the lag.
    releases_owed: list[str] = field(default_factory=list)
    released_through: int = 0
    # Reservations of the next attempt of a task the log still has pending: a commit whose
    # assignment is not logged yet (the leader logs it right after the commit), or a
    # deposed leader's that the next take-over releases. Not a violation either.
    assignments_unlogged: list[str] = field(default_factory=list)
    refused_double_bookings: int = 0
    events_seq: int = 0
    # Messages in the log no fold believes (shared/event_origin.py): not a violation (they
    # changed nothing), but worth an operator's look, so they are counted.
    refused_events: int = 0
    last_refused_seq: int = 0

    @property
    def double_booked_hosts(self) -> int:
        """Hosts over capacity or shared by two gangs."""
        hosts = set()
        for line in self.over_committed + self.hosts_shared_by_gangs:
            hosts.add(line.split(":", 1)[0])
        return len(hosts)

    @property
    def double_booked_ports(self) -> int:
        """(address, port) pairs given to two live attempts, per the log or per Redis."""
        return len({line.split(" to ", 1)[0] for line in self.ports_given_twice})

    @property
    def double_booked_devices(self) -> int:
        """(worker, device) pairs held by two live attempts, per the log or per Redis."""
        return len({line.split(" to ", 1)[0] for line in self.devices_given_twice})

    def violations(self) -> list[str]:
        out = []
        for name in NEVER + PERSISTENT:
            out += [f"{name}: {line}" for line in getattr(self, name)]
        return out

    @property
    def ok(self) -> bool:
        return not self.violations()


def check(state: ClusterState, hosts: Sequence[HostUsage], groups: Sequence[GroupUsage],
          limits_used: Mapping[str, str] | None = None, released_through: int = 0,
          released_at: Mapping[str, int] | None = None) -> Report:
    """`limits_used`: Redis's limits-use hash, read with `hosts` (None: not checked).
    `released_through`: Redis's RELEASED_THROUGH, read with `hosts`; `released_at`: the
    sequence of the event whose fold released each attempt key (those after
    `released_through` at least). A reservation of an attempt released after
    `released_through` is owed by a leader behind the log, not a disagreement; without
    `released_at` every reservation with no live attempt is one."""
    released_at = released_at or {}
    report = Report(events_seq=state.last_seq, refused_events=state.refused_events,
                    released_through=released_through,
                    last_refused_seq=state.last_refused_seq,
                    taken_from_preemptor=list(state.taken_from_preemptor),
                    attempt_keys_reused=list(state.attempt_keys_reused),
                    compacted_live=list(state.compacted_live),
                    over_quota=[x for x in state.over_limits if ": user " in x],
                    over_token_limit=[x for x in state.over_limits if ": token " in x])
    if limits_used is not None:
        report.limit_use_miscounted = miscounted_limit_use(hosts, limits_used)
    redis_hosts = {h.worker_id: h for h in hosts}
    # 1. Capacity, as Redis committed it and as the log says it is used.
    for h in hosts:
        total = sum((a.need for a in h.allocations.values()), Amounts())
        if over := h.used.exceeded(h.capacity):
            report.over_committed.append(f"{h.worker_id}: redis {over} used beyond capacity")
        if total != h.used:
            report.over_committed.append(
                f"{h.worker_id}: redis counters {h.used} != its reservations {total}")
    for w in state.workers.values():
        if over := w.used.exceeded(w.resources.amounts):
            report.over_committed.append(f"{w.worker_id}: live attempts use {over} beyond "
                                         "capacity")
    # 2. Gangs: one holder per group, and no host with live attempts of two gangs.
    holders: dict[str, set[str]] = {}
    # Ports belong to an address, which several workers may share.
    ports_by_address: dict[str, dict[int, str]] = {}
    for w in state.workers.values():
        gangs: set[str] = set()
        ports = ports_by_address.setdefault(w.address or w.worker_id, {})
        devices: dict[int, str] = {}
        for key, (job_id, index, attempt_id) in w.live_attempts.items():
            job = state.jobs[job_id]
            attempt = job.tasks[index].attempt(attempt_id)
            if attempt is None:
                continue
            if attempt.group:
                holders.setdefault(attempt.group, set()).add(job_id)
            cosched = job.spec.coscheduling
            if cosched is not None and not cosched.shareable:
                gangs.add(job_id)
            _hold(ports, attempt.ports.values(), key, f"{w.address or w.worker_id}: port",
                  report.ports_given_twice)
            _hold(devices, attempt.devices, key, f"{w.worker_id}: device",
                  report.devices_given_twice)
        if len(gangs) > 1:
            report.hosts_shared_by_gangs.append(f"{w.worker_id}: {', '.join(sorted(gangs))}")
    for name, jobs in sorted(holders.items()):
        if len(jobs) > 1:
            report.groups_held_twice.append(f"{name}: {', '.join(sorted(jobs))}")
    for g in groups:
        if g.exclusive:
            for member in g.members:
                host = redis_hosts.get(member)
                if host is not None and host.gang not in (None, g.owner):
                    report.groups_held_twice.append(
                        f"{g.name}: owner {g.owner}, but {member} is held by {host.gang}")
    redis_ports: dict[str, dict[int, str]] = {}
    reserved_on: dict[str, str] = {}
    for h in hosts:
        for key in h.allocations:
            if (other := reserved_on.setdefault(key, h.worker_id)) != h.worker_id:
                report.attempt_keys_reused.append(f"{key}: to {other} and to {h.worker_id}"
                                                  " (redis)")
        device_holders: dict[int, str] = {}
        for key, a in sorted(h.allocations.items()):
            _hold(device_holders, a.devices, key, f"{h.worker_id}: device",
                  report.devices_given_twice, " (redis)")
            _hold(redis_ports.setdefault(a.address or h.worker_id, {}), a.ports, key,
                  f"{a.address or h.worker_id}: port", report.ports_given_twice, " (redis)")
    # 3. Redis and the log agree on who holds what.
    for h in hosts:
        live = state.workers[h.worker_id].live_attempts if h.worker_id in state.workers else {}
        for key in sorted(h.allocations):
            if key in live:
                continue
            if released_at.get(key, 0) > released_through:
                report.releases_owed.append(f"{h.worker_id}: {key}")
            elif _not_yet_assigned(state, key):
                report.assignments_unlogged.append(f"{h.worker_id}: {key}")
            else:
                report.reservations_without_attempt.append(f"{h.worker_id}: {key}")
    for w in state.workers.values():
        held = redis_hosts[w.worker_id].allocations if w.worker_id in redis_hosts else {}
        report.attempts_without_reservation += [
            f"{w.worker_id}: {key}" for key in sorted(w.live_attempts) if key not in held]
    return report


def _not_yet_assigned(state: ClusterState, key: str) -> bool:
    """Whether attempt `key` is one the log has yet to assign: its task is pending and the
    key is at or past the task's next attempt id (a key below it is an attempt the log
    already knows, or one it voided). A key that is no attempt key is not (a leak to show,
    not a reason for the checker to stop)."""
    try:
        job_id, index, attempt_id = parse_attempt_key(key)
    except ValueError:
        return False
    task = state.task(job_id, index)
    return (task is not None and task.state == TaskState.PENDING
            and attempt_id >= task.next_attempt_id())


def miscounted_limit_use(hosts: Sequence[HostUsage], limits_used: Mapping[str, str]
                         ) -> list[str]:
    """Where Redis's quota and token counters (redis_keys.LIMITS_USED) differ from the sums
    of the reservations they count (reserve.lua and release.lua change both at once)."""
    want: dict[str, int] = {}
    for h in hosts:
        for a in h.allocations.values():
            if a.user is None:
                continue  # reserved before quotas were tracked: counted nowhere
            for dim in ("cpu", "mem", "dev"):
                if amount := getattr(a.need, dim):
                    want[f"{dim}:{a.user}"] = want.get(f"{dim}:{a.user}", 0) + amount
            for name, n in a.tokens:
                want[f"t:{name}"] = want.get(f"t:{name}", 0) + n
    have = {k: int(v) for k, v in limits_used.items() if int(v)}
    return [f"{k}: counter {have.get(k, 0)}, reservations {want.get(k, 0)}"
            for k in sorted(set(want) | set(have)) if want.get(k, 0) != have.get(k, 0)]


def _hold(holders: dict[int, str], items: Iterable[int], key: str, what: str,
          twice: list[str], suffix: str = "") -> None:
    """Records attempt `key` holding each of `items` (ports, devices); one already held by
    another is a violation line: "<what> <item> to <holder> and <key>"."""
    for item in items:
        if item in holders:
            twice.append(f"{what} {item} to {holders[item]} and {key}{suffix}")
        holders[item] = key


async def check_cluster(js: JetStreamContext, store: ReservationStore, settle: float = 1.0
                        ) -> Report:
    """Folds the log up to now and reads Redis, twice, `settle` seconds apart. Capacity,
    group and port violations count from either read (they must never happen, even for a
    moment); a disagreement between Redis and the log counts only if it persists, since a
    reservation is written just before its assignment is logged and released just after
    its exit is. A reservation whose release the leader still owes (its fold is behind the
    log: Redis's RELEASED_THROUGH is below the event that ended the attempt) is counted
    apart, in `releases_owed`, however long it lasts, and so is one of a task's next
    attempt while the log has the task pending (`assignments_unlogged`)."""
    state = ClusterState()
    events = nats_io.follow_events(js)
    # Only releases after the first read's RELEASED_THROUGH can be owed (it only rises):
    # the others are not kept, so this stays as small as the leader's lag.
    released_at: dict[str, int] = {}
    try:
        reports = []
        floor = -1
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(settle)
            until = await nats_io.last_event_seq(js)
            redis = await store.snapshot()
            if floor < 0:
                floor = redis.released_through
            while state.last_seq < until:
                record = await anext(events)
                for effect in state.apply(record.seq, record.event):
                    if isinstance(effect, Release) and record.seq > floor:
                        released_at[effect.attempt_key] = record.seq
            reports.append(check(state, redis.hosts, redis.groups, redis.limits_used,
                                 redis.released_through, released_at))
    finally:
        await events.aclose()
    first, second = reports
    merged = Report(events_seq=second.events_seq, refused_events=second.refused_events,
                    last_refused_seq=second.last_refused_seq,
                    releases_owed=second.releases_owed,
                    released_through=second.released_through,
                    assignments_unlogged=second.assignments_unlogged)
    for name in NEVER:
        setattr(merged, name, sorted(set(getattr(first, name)) | set(getattr(second, name))))
    for name in PERSISTENT:
        setattr(merged, name, sorted(set(getattr(first, name)) & set(getattr(second, name))))
    # Owed or unlogged at the first read, and neither but still held at the second: the
    # leader has written its releases past the attempt's end since, or the log has
    # assigned the task another attempt, and this reservation stayed.
    merged.reservations_without_attempt = sorted(
        set(second.reservations_without_attempt)
        & set(first.reservations_without_attempt + first.releases_owed
              + first.assignments_unlogged))
    merged.refused_double_bookings = await store.refused_double_bookings()
    return merged
