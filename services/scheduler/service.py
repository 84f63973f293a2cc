"""The scheduler process: wins the leader lease, folds the events stream into ClusterState,
places pending tasks each tick with one fenced Lua commit, and talks to workers.

Side effects are level-triggered where they can be: a worker's heartbeat lists the attempts
it runs, and the leader re-sends a lost assignment or kill from the difference."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
)
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import trace
from redis.exceptions import NoPermissionError

from berth.services.scheduler import (
    attempt_ids,
    compaction,
    fencing,
    frameworks,
    heartbeats,
    idle_tick,
    pending_queue,
    placement,
    preemption,
    schedule_fires,
    sweep,
    warm_fold,
)
from berth.services.scheduler import metrics as scheduler_metrics
from berth.services.scheduler.host_index import HostIndex
from berth.shared import (
    bounded,
    dir_lock,
    metrics,
    nats_io,
    node_health,
    queue_order,
    redis_io,
    service,
    subjects,
    task_rules,
    telemetry,
)
from berth.shared import limits as limit_rules
from berth.shared.capacity import Amounts, GroupClaim
from berth.shared.config import RedisSettings, Settings
from berth.shared.credentials import Role
from berth.shared.event_origin import RefusedEvent, read_heartbeat
from berth.shared.lifecycle import (
    ClusterState,
    Effect,
    JobView,
    Kill,
    Release,
    TaskView,
    WorkerView,
)
from berth.shared.messages import (
    AnyEvent,
    Command,
    DeviceHealthChanged,
    Heartbeat,
    HeartbeatAck,
    JobsCompacted,
    JobSubmitted,
    KillAttempt,
    LeaderAnnouncement,
    NodeAction,
    NodeHealthChanged,
    PendingReason,
    PendingReasonsChanged,
    PreemptionReleased,
    QuotaSet,
    ResetWorker,
    RunAttempt,
    TaskAssigned,
    TasksAssigned,
    TasksPreempted,
    TaskUnschedulable,
    TokenLimitSet,
    WorkerDeclaredDead,
    WorkerRegistered,
    attempt_key,
    encode,
    parse_attempt_key,
)
from berth.shared.reservations import (
    Eviction,
    HostRecord,
    NotDurable,
    Reservation,
    ReservationConflict,
    ReservationStore,
    StaleEpochError,
)
from berth.shared.states import ATTEMPT_LIVE, TaskState

log = logging.getLogger("berth.scheduler")
tracer = telemetry.tracer("berth.scheduler")


# The share of the lease TTL a leader does not count on: its clock and Redis's may run at
# slightly different rates, and a renewal's answer comes after Redis set the expiry.
LEASE_SAFETY = 0.2


class LostLeadership(Exception):
    pass


MAX_TICK_LINKS = 128
# Seconds a background flush of releases waits, so the releases of reports folded meanwhile
# share its Redis call. Short: an ended attempt's reservation stays that much longer.
RELEASE_GATHER = 0.005
# A leader must reach NATS as well as Redis: it renews its lease only while its last NATS
# round trip that was answered was sent within this many lease TTLs (docs/reliability.md).
BUS_FRESH_TTLS = 1.0
# Placements per tick: a tick runs without yielding, and the lease must be renewed (every
# TTL/3) while thousands of hosts free up at once. The next tick follows at once.
MAX_TICK_PLACEMENTS = 1000
# Preemptions a tick commits at most (each is one Lua call and one logged event).
MAX_TICK_PREEMPTIONS = 200
# Pending reasons one announcement looks at, at most: the first sweep of a full cluster with
# 150,000 tasks waiting finds each one's reason new, and announcing them all at once held
# the event loop 0.41 s before the publish (20,000: 52 ms); the rest go out in the next
# announcements, one a second.
ANNOUNCED_AT_ONCE = 20_000
TICK_STATS_EVERY = 10.0


def _bare_unit(job: JobView) -> placement.Unit:
    """A job's unit with no tasks in it: what its spec says of every task."""
    spec = job.spec
    return placement.Unit(
        job_id=job.job_id, indices=(), need=spec.resources.amounts,
        device_kind=spec.resources.device_kind, constraints=tuple(spec.constraints),
        ports=tuple(spec.ports), gang=spec.coscheduling, user=spec.user,
        tokens=tuple(sorted(spec.tokens.items())),
    )


class TickStats:
    """Logs, every TICK_STATS_EVERY seconds with activity, how many ticks ran, how long
    they took and how much they placed: where a busy scheduler's time goes."""

    def __init__(self) -> None:
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.since = now
        self.ticks = 0
        self.seconds = 0.0
        self.longest = 0.0
        self.placed = 0
        self.longest_placing = 0.0
        self.longest_sweeping = 0.0
        self.skipped = 0

    def add(self, seconds: float, placing: float, placed: int, pending: int,
            skipped: bool = False, sweeping: float = 0.0) -> None:
        """`placing`: the tick's synchronous part (ordering units, choosing hosts), which
        holds the event loop; `skipped`: nothing had changed since a tick that placed
        nothing (idle_tick.py); `sweeping`: its sweep slice's, which holds it too (sweep.py)."""
        self.ticks += 1
        self.skipped += skipped
        self.seconds += seconds
        self.longest_placing = max(self.longest_placing, placing)
        self.longest_sweeping = max(self.longest_sweeping, sweeping)
        self.longest = max(self.longest, seconds)
        self.placed += placed
        now = time.monotonic()
        if now - self.since < TICK_STATS_EVERY:
            return
        if self.placed or pending:
            window = now - self.since
            log.info("ticks: %d in %.0f s (%d skipped: nothing new; %.0f%% busy, mean %.1f "
                     "ms, longest %.0f ms, longest placing %.0f ms, longest sweep slice %.0f "
                     "ms), placed %d (%.0f/s), %d pending", self.ticks, window, self.skipped,
                     100 * self.seconds / window, 1000 * self.seconds / self.ticks,
                     1000 * self.longest, 1000 * self.longest_placing,
                     1000 * self.longest_sweeping, self.placed, self.placed / window, pending)
        self._reset(now)


class Leader:
    """Everything one term of leadership holds; a new term starts from a fresh fold."""

    def __init__(
        self,
        settings: Settings,
        nc: NATS,
        store: ReservationStore,
        scheduler_id: str,
        lease: fencing.Lease,
        bus_ok_at: float | None = None,
        state: ClusterState | None = None,
        state_from: Callable[[], Awaitable[ClusterState]] | None = None,
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.store = store
        self.scheduler_id = scheduler_id
        self.lease = lease
        self.epoch = lease.epoch
        # The answer to a heartbeat: the epoch a worker may trust (docs/reliability.md),
        # and the interval asked of it (heartbeats.pace, set by _pace_heartbeats).
        self.heartbeat_pace = settings.heartbeat_interval
        self.ack = encode(HeartbeatAck(epoch=self.epoch))
        # Until when (CLOCK_MONOTONIC) the lease is surely still ours: its TTL, less a
        # safety share, from when the acquiring or renewing call was sent (Redis starts the
        # TTL on receipt, later). Past it, this leader commands, acknowledges and publishes
        # nothing: a successor may be leading already (docs/reliability.md).
        self.lease_until = lease.sent + self._lease_for()
        # When the last NATS round trip that was answered was sent (CLOCK_MONOTONIC): a
        # leader cut off from NATS renews its lease no more, so a standby takes over.
        self.bus_ok_at = time.monotonic() if bus_ok_at is None else bus_ok_at
        self.ping_js = nc.jetstream(timeout=settings.lease_ttl / 2)
        # A standby's warm fold (warm_fold.py), trusted only as the fold of the log up to
        # its last_seq: the rest is folded here, and Redis reconciled from the result.
        self.state = (state if state is not None
                      else ClusterState(settings.fair_share.half_life))
        self.state.finished_jobs = []
        # Where the term's fold comes from (a standby's warm fold handed over): asked inside
        # the take-over, while the lease is kept, since stopping the standby's follower and
        # checking its stream are round trips that, behind a long backlog, once outlasted a
        # short lease before the term had begun to renew it.
        self.state_from = state_from
        self.events: AsyncGenerator[nats_io.EventRecord] | None = None
        # Set once the take-over is done and this term leads (what bench/takeover.py times).
        self.leading = asyncio.Event()
        self.wake = asyncio.Event()
        # Set while the fold has folded every event this client holds (nats_io's follower):
        # a tick's pause ends early then (_pause).
        self.fold_drained = asyncio.Event()
        self.last_heartbeat: dict[str, float] = {}
        # Heartbeats heard and to be answered (their reply subjects), for `_send_acks`; and
        # the tasks of those that called for commands.
        self.acks: list[str] = []
        self.acks_queued = asyncio.Event()
        self.heartbeat_work: set[asyncio.Task[None]] = set()
        # The last reset sent to each worker: (incarnation, when, CLOCK_MONOTONIC).
        self.resets_sent: dict[str, tuple[str, float]] = {}
        # Each unfinished job's trace context, from its submit's headers: its traceparent
        # alone (a string, not the message's headers) unless it carried more to propagate.
        self.trace_headers: dict[str, str | dict[str, str]] = {}
        # Pending reasons published but perhaps not folded yet (see _announce_pending_reasons).
        self.reasons_in_flight: dict[tuple[str, int], str] = {}
        self.reasons_in_flight_seq = 0
        self.reasons_announced_at = -float("inf")
        self.unit_templates: dict[str, tuple[queue_order.Waiting, placement.Unit]] = {}
        # Each job's place in the last tick's placement order (the preemptions follow it).
        self.queue_rank: dict[str, int] = {}
        self.pending_queue = pending_queue.PendingQueue(self._need_of)
        # The fold the pending queue was filed from: it follows that fold's pending_changes.
        self.queue_follows: ClusterState | None = None
        # The live hosts, kept between ticks from the fold's workers_changed, and the fold
        # they follow (a new term's is indexed whole).
        self.host_index = HostIndex()
        self.index_follows: ClusterState | None = None
        # Workers whose quarantine the cap refused, so the refusal is logged once each.
        self.quarantine_refused: set[str] = set()
        # Releases folded but not yet written to Redis: written together, as soon as the
        # fold pauses, and always before a tick reserves (the Lua must never find in Redis
        # what the fold has already freed).
        self.unreleased: list[tuple[str, str]] = []
        # Whether every release owed for the events folded so far is either written or in
        # `unreleased`: not so until the take-over's reconcile has released what the
        # replay ended (the replay carries out no effects). Until then a write of releases
        # says nothing of how far they go (redis_keys.RELEASED_THROUGH).
        self.releases_complete = False
        self.placing_seconds = 0.0  # the last tick's synchronous part (TickStats)
        self.sweeping_seconds = 0.0  # and its sweep slice's
        # The last tick, if it placed, committed and preempted nothing: the ticks after it
        # are skipped while nothing it was given changes (idle_tick.py).
        self.idle: idle_tick.IdleTick | None = None
        self.skipped = False  # whether the last tick was skipped (TickStats)
        # Whether the last tick left tasks it saw waiting (at its limit, or for room,
        # quotas or tokens): _pause.
        self.left_waiting = False
        # When what the last tick held back comes due (wall clock): a retry backoff's end,
        # a waiting task's scheduling timeout, the pending reasons' next announcement.
        self.backoff_due = idle_tick.NEVER
        self.overdue_due = idle_tick.NEVER
        self.reasons_due = idle_tick.NEVER
        # The sweep of the waiting tasks the ticks' walks do not reach, while one runs,
        # and when the next starts (wall clock; services/scheduler/sweep.py).
        self.sweep: sweep.Sweep | None = None
        self.sweep_due = 0.0
        # The needs (one task's) no live host has room for at this tick's start: the jobs
        # of these are left out of its walk (the sweep looks at them; _stop_below).
        self.left_out: frozenset[Amounts] = frozenset()
        # Jobs with a task that entered the pending tasks since the last tick's walk: one
        # left out is looked at by the sweep at once, not at the next sweep (its user
        # learns at once that it fits nowhere).
        self.arrived: dict[str, None] = {}
        # Pending reasons found (by the ticks and the sweep) while their announcement
        # waited for BERTH_PENDING_REASON_INTERVAL: a sweep's slice is looked at once.
        self.unannounced: dict[tuple[str, int], str] = {}
        # Events this term folded (a metric): a plain int, since a prometheus Counter's
        # lock costs microseconds per event in a take-over's fold of a long log.
        self.folded = 0
        # Assignments committed but not yet stored in the log (their publish is awaiting
        # its ack, e.g. while a NATS cluster elects a new stream leader): no run command
        # may go out for them, or the worker's reports could be logged before them.
        self.unlogged: set[str] = set()
        # Attempt ids a deposed leader reserved whose TaskAssigned is not folded (yet, or
        # void): never handed out again (services/scheduler/attempt_ids.py).
        self.ids_in_redis: attempt_ids.TakenIds = {}
        self.release_lock = asyncio.Lock()
        self.release_task: asyncio.Task[None] | None = None
        # Hosts whose capacity is not yet recorded in Redis, by worker id: written in the
        # background, many per round trip, and always before a tick reserves (reserve.lua
        # refuses a host it does not know). The fold never waits for Redis on them.
        self.unregistered: dict[str, HostRecord] = {}
        self.register_lock = asyncio.Lock()
        self.register_task: asyncio.Task[None] | None = None
        # The version of the limits (shared/limits.py) written to Redis by this term (-1:
        # none yet), and the one the current tick's placement was computed with.
        self.limits_synced = -1
        self.tick_limits_seq = 0
        self.compactor = compaction.Compactor(self.js, lambda: self.state, self.epoch,
                                              self._renew_lease, self._apply_own)

    # --- term ---------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        # Logged first: a leader another one was logged after never tells workers its epoch.
        elected_seq = await fencing.announce(self.js, self.scheduler_id, self.lease)
        await self.nc.publish(
            subjects.LEADER,
            encode(LeaderAnnouncement(epoch=self.epoch, scheduler_id=self.scheduler_id)),
        )
        # The lease is kept from the start: catching up on a long log can outlast its TTL,
        # and a lease lost then would be won again, and lost again, on every take-over.
        taking_over = asyncio.create_task(self._take_over(elected_seq))
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(self._keep_lease(), name="lease"),
            asyncio.create_task(self._watch_bus(), name="bus"),
            asyncio.create_task(stop.wait(), name="stop"),
            taking_over,
        ]
        hb_sub = compact_sub = None
        try:
            if await self._until_first_ends(tasks) != taking_over:
                return  # stopped while taking over
            tasks.remove(taking_over)
            assert self.events is not None  # set by the take-over
            hb_sub = await nats_io.subscribe_now(self.nc, subjects.HEARTBEATS_ALL,
                                                 self._on_heartbeat)
            compact_sub = await self.nc.subscribe(subjects.ADMIN_COMPACT,
                                                  cb=self.compactor.on_request)
            tasks += [
                asyncio.create_task(self.compactor.run(self.settings.job_retention),
                                    name="compaction"),
                asyncio.create_task(self._follow(self.events), name="follow"),
                asyncio.create_task(self._tick_loop(), name="tick"),
                asyncio.create_task(self._send_acks(), name="acks"),
                asyncio.create_task(self._watch_workers(), name="watch"),
                asyncio.create_task(schedule_fires.run(self.js, self.state, self._check_lease),
                                    name="schedules"),
            ]
            await self._until_first_ends(tasks)
        finally:
            await service.cancel_and_wait([*tasks, *self.heartbeat_work])
            # The background flushes retry until written: this term's end ends them, once
            # the tasks that may start one (the fold, heartbeat work) have ended.
            await service.cancel_and_wait(
                [t for t in (self.release_task, self.register_task, *self.heartbeat_work)
                 if t is not None])
            if hb_sub is not None:
                await hb_sub.unsubscribe()
            if compact_sub is not None:
                await compact_sub.unsubscribe()
            if self.events is not None:
                await self.events.aclose()
            gc.unfreeze()  # this term's state may be collected once the Leader is dropped

    @staticmethod
    async def _until_first_ends(tasks: list[asyncio.Task[Any]]) -> asyncio.Task[Any]:
        """Waits for the first task to end and returns it; re-raises what ended it
        (LostLeadership, StaleEpochError or a crash). The others go on running."""
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        first = done.pop()
        first.result()
        return first

    async def _take_over(self, elected_seq: int) -> None:
        if self.state_from is not None:
            self.state = await self.state_from()
            self.state.finished_jobs = []
            self._heard_from_bus()
            self.state_from = None  # the term's fold is the warm one now
        self.events = events = nats_io.follow_events(self.js, self.state.last_seq + 1,
                                                     drained=self.fold_drained)
        await self._replay(events, elected_seq)
        # What the replay built lives as long as the term: keep the collector off it.
        gc.freeze()
        await self._reconcile()
        # Before the first heartbeat is answered: a large cluster's workers stay paced.
        await self._pace_heartbeats(len(self._live_workers()))
        log.info(
            "leading with epoch %d: %d jobs, %d workers, %d pending tasks (%d events folded "
            "in the take-over)", self.epoch, len(self.state.jobs), len(self.state.workers),
            len(self.state.pending), self.folded,
        )
        self.leading.set()

    async def _replay(self, events: AsyncGenerator[nats_io.EventRecord], until: int) -> None:
        """Folds the log up to our own LeaderElected; effects are not carried out here but
        derived afterwards by _reconcile (the log is the truth, not what we would redo)."""
        while self.state.last_seq < until:
            record = await anext(events)
            self._heard_from_bus()
            self._remember(record)
            self.state.apply(record.seq, record.event)
            self.folded += 1

    async def _reconcile(self) -> None:
        """Makes Redis and the workers agree with the folded state."""
        await self._flush_releases()
        self.limits_synced = -1
        await self._sync_limits(self.state.limits.seq)
        for worker in list(self.state.workers.values()):
            if worker.alive:
                self._register_host(worker)
        await self._flush_registrations()
        usage = await self.store.host_usage()
        attempt_ids.note_reserved(
            self.state, (key for host in usage for key in host.allocations), self.ids_in_redis)
        # The fold goes on meanwhile (reports end attempts, their releases go out in the
        # background), so it is read after Redis, with no await in between: an attempt it
        # ends while Redis is read is then released twice (harmless), never re-reserved.
        # Read before, such an attempt was "missing" from Redis, whose release had already
        # gone out, and its reservation was written back for good (bench/partitions.py
        # nats-minority, 2 disagreements once in 15 runs).
        live = {w.worker_id: set(w.live_attempts) for w in self.state.workers.values()}
        folded_through = self.state.last_seq
        stale: list[tuple[str, str]] = []
        missing: dict[str, list[str]] = {}
        holds: dict[str, list[str]] = {}
        for host in usage:
            view = self.state.workers.get(host.worker_id)
            if host.held_for and (view is None or view.held_for != host.held_for):
                # Held in Redis by a preemption whose event never reached the log (its
                # leader died in between): its victims were never stopped, so let go.
                holds.setdefault(host.held_for, []).append(host.worker_id)
            held = live.get(host.worker_id, set())
            stale += [(host.worker_id, key) for key in host.allocations if key not in held]
            if lost := [k for k in held if k not in host.allocations]:
                missing[host.worker_id] = lost
        for job_id, worker_ids in holds.items():
            log.info("letting go of %d hosts held in Redis for %s by an unlogged preemption",
                     len(worker_ids), job_id)
            await self.store.unhold(self.epoch, job_id, worker_ids)
        # Stale ones first: the capacity they hold may be what a lost one needs back.
        if stale:
            log.info("releasing %d reservations with no live attempt", len(stale))
            await self.store.release(self.epoch, stale, folded_through)
        # Every reservation in Redis of an attempt the fold has ended was in `stale` (and
        # none is ever made again), so from here the releases owed are all in `unreleased`.
        self.releases_complete = True
        # Under the release lock, and only what is still live: a release folded from now on
        # reaches Redis after the reservation it undoes.
        async with self.release_lock:
            for worker_id, keys in missing.items():
                view = self.state.workers.get(worker_id)
                keys = [k for k in keys if view is not None and k in view.live_attempts]
                if not keys:
                    continue
                # Only possible if Redis lost writes (e.g. a failover to a replica that was
                # behind): re-reserve what the log says is running.
                log.warning("re-reserving %d attempts on %s missing from Redis", len(keys),
                            worker_id)
                again = [self._reservation(worker_id, k) for k in keys]
                # Already running: a limit lowered since stops nothing (docs/placement.md).
                await self.store.reserve(self.epoch, again, self._group_claims(again),
                                         check_limits=False)
        # Copies: a send may yield to the fold, which changes these dicts.
        for worker in list(self.state.workers.values()):
            for job_id, index, attempt_id in list(worker.live_attempts.values()):
                task = self.state.task(job_id, index)
                assert task is not None
                attempt = task.attempt(attempt_id)
                assert attempt is not None
                if attempt.kill_requested:
                    await self._send_kill(Kill(worker.worker_id, worker.incarnation, job_id,
                                               index, attempt_id, "job ended"))
                elif attempt.state == TaskState.ASSIGNED:
                    await self._send_run(worker, task, attempt_id)

    def _reservation(self, worker_id: str, key: str) -> Reservation:
        """The reservation the fold says attempt `key` holds on `worker_id`."""
        job_id, index, attempt_id = parse_attempt_key(key)
        job = self.state.jobs[job_id]
        attempt = job.tasks[index].attempt(attempt_id)
        assert attempt is not None
        res = job.spec.resources
        worker = self.state.workers.get(worker_id)
        return Reservation(worker_id, key, job_id, res.amounts, res.device_kind,
                           tuple(attempt.ports.values()), attempt.group,
                           worker.address if worker else "", tuple(attempt.devices),
                           job.spec.user, tuple(sorted(job.spec.tokens.items())))

    async def _sync_limits(self, version: int) -> None:
        """Writes limits version `version` (the newest if no longer kept) to Redis, unless
        this term wrote it already: reserve.lua enforces what Redis holds."""
        if version == self.limits_synced:
            return
        limits = self.state.limit_versions.get(version, self.state.limits)
        await self.store.set_limits(self.epoch, limit_rules.redis_fields(limits))
        self.limits_synced = limits.seq

    def _group_claims(self, reservations: list[Reservation]) -> list[GroupClaim]:
        names = {r.group for r in reservations if r.group}
        return [GroupClaim(g.name, g.job_id, tuple(g.members), g.exclusive)
                for name in sorted(names) if (g := self.state.groups.get(name))]

    # --- the event log ------------------------------------------------------------------

    def _remember(self, record: nats_io.EventRecord) -> None:
        if finished := self.state.finished_jobs:
            # What this term keeps per job goes when the job ends: at 10,000 hosts the
            # finished jobs' trace headers and unit templates were ~1 KiB each, for as long
            # as the fold keeps the jobs (docs/performance.md).
            for job_id in finished:
                self.trace_headers.pop(job_id, None)
                self.unit_templates.pop(job_id, None)
            finished.clear()
        event = record.event
        if isinstance(event, JobSubmitted) and "traceparent" in record.headers:
            self.trace_headers[event.job_id] = telemetry.trace_carrier(record.headers)

    async def _follow(self, events: AsyncIterator[nats_io.EventRecord]) -> None:
        async for record in events:
            self._heard_from_bus()
            self._remember(record)
            pending = len(self.state.pending)
            effects = self.state.apply(record.seq, record.event)
            self.folded += 1
            self._check_newest()
            self._on_event(record.event)
            if effects:  # most events have none: no coroutine for them
                await self._carry_out(effects)
            # Only what can let more work be placed wakes a tick (new or requeued tasks here,
            # a new worker or freed capacity below), not every report: ticks must leave
            # the fold time to keep up.
            if len(self.state.pending) > pending:
                self.wake.set()

    def _on_event(self, event: AnyEvent | None) -> None:
        if isinstance(event, DeviceHealthChanged) and event.healthy:
            self.wake.set()  # a device back in service may let waiting work in
        if isinstance(event, NodeHealthChanged) and event.action == NodeAction.UNCORDON:
            self.wake.set()  # so may a worker back in service
            # Released: a later refusal to quarantine it is news again (and the set stays
            # as small as the workers waiting for an operator).
            self.quarantine_refused.discard(event.worker_id)
        if isinstance(event, QuotaSet | TokenLimitSet):
            self.wake.set()  # so may a raised limit
        if isinstance(event, JobsCompacted):
            # What this term keeps per job goes with the job (docs/retention.md).
            for job_id in event.job_ids:
                self.trace_headers.pop(job_id, None)
                self.unit_templates.pop(job_id, None)
        if isinstance(event, WorkerRegistered):
            worker = self.state.workers[event.worker_id]
            if worker.incarnation == event.incarnation:
                self._register_host(worker)
                self.wake.set()

    async def _apply_own(self, event: AnyEvent) -> None:
        """Folds an event this leader has just logged, at once (folding it again from the
        stream changes nothing)."""
        await self._carry_out(self.state.apply(0, event))

    def _register_host(self, worker: WorkerView) -> None:
        """Starts a live worker's heartbeat clock (a new leader or a new worker gets the
        full grace before it can be declared dead) and has its capacity recorded in Redis,
        in the background: a fleet registering at once cost one Redis round trip per host,
        each holding up the fold (1,600 hosts: ~0.4 s before any placement)."""
        self.unregistered[worker.worker_id] = HostRecord(
            worker.worker_id, worker.resources.amounts, worker.resources.device_kind,
            tuple(d.index for d in worker.devices))
        self.last_heartbeat[worker.worker_id] = time.monotonic()
        if self.register_task is None or self.register_task.done():
            self.register_task = asyncio.create_task(
                self._in_background(self._flush_registrations, "recording hosts"))

    async def _flush_registrations(self) -> None:
        async with self.register_lock:
            while self.unregistered:
                batch = self.unregistered
                self.unregistered = {}
                try:
                    await self.store.register_hosts(self.epoch, list(batch.values()))
                except BaseException:
                    # Still owed (a registration queued since is newer: it stays).
                    self.unregistered = batch | self.unregistered
                    raise

    async def _carry_out(self, effects: list[Effect]) -> None:
        releases = [(e.worker_id, e.attempt_key) for e in effects if isinstance(e, Release)]
        if releases:
            self.unreleased.extend(releases)
            if self.release_task is None or self.release_task.done():
                self.release_task = asyncio.create_task(
                    self._in_background(self._gather_and_flush_releases, "releasing"))
            self.wake.set()  # freed capacity may let waiting work in
        for effect in effects:
            if isinstance(effect, Kill):
                await self._send_kill(effect)

    async def _gather_and_flush_releases(self) -> None:
        """A background flush, after RELEASE_GATHER: the releases of the reports folded
        meanwhile go in the same Lua call. One call per report was ~10 % of the scheduler's
        CPU at 600 jobs/s (docs/performance.md). Nothing waits for it: a commit carries
        what is owed in its reserve's round trip."""
        await asyncio.sleep(RELEASE_GATHER)
        await self._flush_releases()

    async def _flush_releases(self) -> None:
        while self.unreleased:
            async with self._owed_releases() as (owed, through):
                await self.store.release(self.epoch, owed, through)

    @contextlib.asynccontextmanager
    async def _owed_releases(self) -> AsyncIterator[tuple[list[tuple[str, str]], int]]:
        """The releases owed, taken under the release lock for one write, and the events
        sequence through which they are all the fold owes (0 before the take-over's
        reconcile): effects are carried out before the fold's next await, so every release
        of an event folded so far is in `unreleased` or already written. Owed again if the
        write fails (the next flush or commit retries them), unless Redis refused the
        reservations written after them: they stand then."""
        async with self.release_lock:
            owed, self.unreleased = self.unreleased, []
            through = self.state.last_seq if self.releases_complete else 0
            try:
                yield owed, through
            except ReservationConflict:
                raise
            except BaseException:
                self.unreleased[:0] = owed
                raise

    @staticmethod
    async def _in_background(flush: Callable[[], Awaitable[None]], what: str) -> None:
        """Runs a flush of writes owed to Redis (releases, host registrations) as a task of
        its own. What it could not write stays owed and is tried again, with backoff, until
        written or the term ends (a commit also carries what is owed). Left to the next commit, an
        idle leader kept the reservations of attempts ended after a Sentinel failover."""
        backoff = fencing.Backoff()
        outage = fencing.Outage(f"Redis for {what}")
        while True:
            try:
                await flush()
                outage.recovered()
                return
            except redis_io.UNREACHABLE as exc:
                # Said once, when the term ends on it (the lease cannot be renewed either).
                log.debug("%s in Redis failed (%s); retrying", what, exc)
            except StaleEpochError:
                # Refused for good: another term leads (this one ends at its next renewal).
                # Retried, it was logged every 30 s for as long as the term lasted.
                log.info("%s refused: this leader's epoch is over", what)
                return
            except Exception as exc:
                outage.failed(exc, "still owed")
            await asyncio.sleep(backoff.next())

    # --- leadership ---------------------------------------------------------------------

    async def _keep_lease(self) -> None:
        every = self.settings.lease_ttl / 3
        while True:
            slept = time.monotonic()
            await asyncio.sleep(every)
            late = time.monotonic() - slept - every
            if late > every / 2:
                # Something held the event loop: past TTL/3 more, the lease lapses.
                log.warning("lease renewal ran %.2f s late (lease TTL %.1f s)", late,
                            self.settings.lease_ttl)
                scheduler_metrics.LEASE_RENEWALS_LATE.inc()
            await self._renew_lease()

    async def _watch_bus(self) -> None:
        every = self.settings.lease_ttl / 4
        while True:
            sent = time.monotonic()
            if await bus_answers(self.ping_js):
                self.bus_ok_at = max(self.bus_ok_at, sent)
            await asyncio.sleep(max(0.0, sent + every - time.monotonic()))

    def _heard_from_bus(self) -> None:
        """An event delivered is NATS answering too. While a long backlog is folded, the
        bus watcher's round trip waits behind it in the same socket and times out, though
        the server is there: without this, a take-over of a long log stood down for "NATS
        has not answered". A leader cut off stops hearing events once what its client had
        already read is folded, and stands down then."""
        self.bus_ok_at = time.monotonic()

    async def _renew_lease(self) -> None:
        """Renews the lease; raises LostLeadership if it is no longer ours at our epoch, or
        if NATS has not answered this leader lately (a leader that cannot reach NATS can
        neither command nor hear the workers: it must let a standby lead)."""
        unheard = time.monotonic() - self.bus_ok_at
        # Not while the standby's follower is stopped and handed over: its unsubscribe and
        # stream check wait behind the backlog it was reading, as the bus watcher's ping
        # does; the fold that follows hears every event it folds.
        if self.state_from is None and unheard > self.settings.lease_ttl * BUS_FRESH_TTLS:
            raise LostLeadership(f"NATS has not answered for {unheard:.1f} s")
        ttl_ms = int(self.settings.lease_ttl * 1000)
        sent = time.monotonic()
        epoch = await self.store.acquire_lease(self.scheduler_id, ttl_ms)
        if epoch != self.epoch:
            raise LostLeadership(f"lease now at epoch {epoch or 'held by another'}")
        self.lease_until = max(self.lease_until, sent + self._lease_for())

    def _lease_for(self) -> float:
        return self.settings.lease_ttl * (1 - LEASE_SAFETY)

    def _check_lease(self) -> None:
        """Raises LostLeadership once the lease may have lapsed by this process's own
        clock, whether or not Redis could be asked (a paused or cut-off leader), or once the
        log believes a newer leader than this one: its assignments would be void."""
        if time.monotonic() >= self.lease_until:
            scheduler_metrics.LEASE_LAPSED.inc()
            raise LostLeadership("the lease may have lapsed (not renewed in time)")
        self._check_newest()

    def _check_newest(self) -> None:
        if self.state.epoch > self.epoch:
            raise fencing.Superseded(f"the log elected epoch {self.state.epoch}, above this "
                                     f"leader's {self.epoch}")

    # --- scheduling ---------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        stats = TickStats()
        while True:
            await service.wait_event(self.wake, self.settings.tick_interval)
            self.wake.clear()
            started = time.perf_counter()
            placed = await self.tick()
            took = time.perf_counter() - started
            stats.add(took, self.placing_seconds, placed, len(self.state.pending),
                      self.skipped, self.sweeping_seconds)
            if self.placing_seconds:  # a tick with pending work
                scheduler_metrics.tick_done(took, placed)
            await self._pause(took)

    async def _pause(self, took: float) -> None:
        """After a tick that took `took` seconds. At most half the time in ticks: the fold of
        reports (which frees capacity) and heartbeats get the other half, however busy
        placement is. A tick that placed every task it saw pauses for its synchronous part
        (`placing_seconds`), then only until the fold has caught up: the next tick's work
        is what arrived meanwhile, and the rest of the pause, matching the tick's waits on
        Redis and JetStream, during which the fold ran anyway, only delays it. One that left
        tasks waiting (at its limit, or for room, quotas or tokens) pauses for as long as
        it took, as every tick did: those wait for the fold to bring freed capacity, and
        ticks back to back would only place them in smaller batches, each tick's fixed
        costs paid again (on 2 cores: fewer real jobs a second, and at 10,000 hosts late
        lease renewals, docs/performance.md)."""
        if self.left_waiting:
            await asyncio.sleep(took)
            return
        # Never less than the placing: at 10,000 hosts, ticks of a few tasks each, each
        # visiting every host, otherwise held the loop back to back (a whole core).
        placing = min(self.placing_seconds, took)
        await asyncio.sleep(placing)  # a turn for everything ready, at the least
        await service.wait_event(self.fold_drained, took - placing)

    def _live_workers(self) -> list[WorkerView]:
        return [w for w in self.state.workers.values() if w.alive]

    def _units(self) -> Iterator[placement.Unit]:
        """Pending work in placement order (shared/queue_order.py: priority band, then
        users by fair share, each user's jobs FIFO). A gang
        is one unit, and only once none of its tasks is still live (it is placed whole).
        Lazy: a tick stops after MAX_TICK_PLACEMENTS, so with tens of thousands pending
        only the first units are ever built (sorting their keys is cheap). A task in its
        retry backoff is left out until its retry_at (and a gang while any member is)."""
        now = time.time()
        held = task_rules.held_back(self.state.backoff, now)
        self.backoff_due = idle_tick.first_after(self.state.backoff.values(), now)
        self._file_pending()
        pending = self.pending_queue.tasks
        fair = self.settings.fair_share

        def charge(job_id: str) -> float | None:
            tasks = pending(job_id)
            n = len(tasks) if not held else sum((job_id, i) not in held for i in tasks)
            if not n:
                return None
            return self._unit_template(self.state.jobs[job_id])[0].charge * n

        self.queue_rank = {}
        held_jobs = {job_id for job_id, _ in held}
        for job_id in self.pending_queue.ordered(
                queue_order.costs(self.state.recent_use, now, fair), charge, self.left_out):
            self.queue_rank[job_id] = len(self.queue_rank)
            unit = self._unit_of(job_id, held, held_jobs)
            if unit is not None:
                yield unit

    def _unit_of(self, job_id: str, held: AbstractSet[tuple[str, int]],
                 held_jobs: AbstractSet[str], keep: bool = True) -> placement.Unit | None:
        """A pending job's unit: its pending tasks not `held` back (in a retry backoff);
        None for a gang while any of it is held back or live, or a job all held back.
        `keep`: its template is kept for the next ticks (they are likely to reach it)."""
        job = self.state.jobs[job_id]
        if job.spec.coscheduling and (job_id in held_jobs or any(
                t.state in ATTEMPT_LIVE for t in job.tasks)):
            return None
        cached = self.unit_templates.get(job_id)
        # A sweep looks at a job once in SWEEP_EVERY: a template kept for each of 150,000
        # waiting jobs would cost it more time and memory than it saves.
        t = cached[1] if cached is not None else (
            self._unit_template(job)[1] if keep else _bare_unit(job))
        indices = tuple(sorted(i for i in self.pending_queue.tasks(job_id)
                               if (job_id, i) not in held))
        if not indices:
            return None
        # Built field by field: dataclasses.replace costs several times more.
        return placement.Unit(t.job_id, indices, t.need, t.device_kind, t.constraints,
                              t.ports, t.gang, t.user, t.tokens)

    def _file_pending(self) -> None:
        """Files what entered or left the pending tasks since the last call."""
        state = self.state
        if self.queue_follows is state and state.pending_changes is not None:
            if state.pending_changes:
                self.pending_queue.apply(state.pending_changes, self._place_of)
                self.arrived.update((job_id, None) for (job_id, _), entered
                                    in state.pending_changes.items() if entered)
        else:  # a new term's fold (or the first tick): filed whole, then kept up to date
            self.pending_queue = pending_queue.PendingQueue(self._need_of)
            self.pending_queue.sync(state.pending, self._place_of)
            self.queue_follows = state
        state.pending_changes = {}

    def _need_of(self, job_id: str) -> tuple[Amounts, bool] | None:
        job = self.state.jobs.get(job_id)
        if job is None:
            return None
        return job.spec.resources.amounts, job.spec.coscheduling is not None

    def _stop_below(self, now: float) -> Amounts | None:
        """Placement's `stop_below` for this tick: the least need of any task waiting, or
        None for a walk of the whole queue while a waiting task might preempt (a unit the
        walk never reached would never be a preemptor). Otherwise the jobs of a need no
        live host has room for are left out of the walk (`left_out`: 150,000 GPU jobs
        waiting for busy GPUs, beside cpu jobs that fit, made every tick look at each of
        them, 2.7 s). Starts a sweep when one is due (sweep.py): it sees the tasks a walk
        stopped short never reaches, and those left out."""
        self.left_out = frozenset()
        arrived, self.arrived = self.arrived, {}
        queue = self.pending_queue
        top = queue.top_band()
        if top is None or preemption.could_preempt(top, self._lowest_band_running(),
                                                   queue.gang_waits()):
            self.sweep, self.sweep_due = None, now + sweep.SWEEP_EVERY  # this walk sees all
            return None
        started = self.sweep is None and now >= self.sweep_due
        if started:
            self.sweep, self.sweep_due = sweep.Sweep(list(queue.indices)), now + sweep.SWEEP_EVERY
        # Free capacity only shrinks during a walk: what fits nowhere at its start never
        # fits in it.
        self.left_out = queue.needs_beyond(self.host_index.most_free())
        if self.left_out and arrived and not started:
            jobs = self.state.jobs
            late = [job_id for job_id in arrived if job_id in queue.indices
                    and jobs[job_id].spec.resources.amounts in self.left_out]
            if late:
                if self.sweep is None:
                    self.sweep = sweep.Sweep(late)
                else:
                    self.sweep.jobs += late
        # With every need left out the walk is empty; the least of all still bounds it.
        return queue.least_need(self.left_out) or queue.least_need()

    def _unseen_for_room(self, walked: placement.Placement) -> bool:
        """Whether the walk left waiting jobs unseen for want of room: it stopped short
        (`exhausted`), or their need fits on no host (`left_out`). The sweep sees them."""
        return walked.exhausted or bool(self.left_out)

    def _sweep_after(self, walked: placement.Placement) -> dict[tuple[str, int], str]:
        """The pending reasons of the running sweep's next slice, if any, after a walk that
        stopped short for want of capacity or left jobs out (`left_out`). A walk cut short
        by its limit leaves the rest
        to the next tick, which follows at once (and the tasks there are about to be
        placed, not waiting for room: a slice would only place them in vain); a walk that
        looked at every unit has done what the sweep does."""
        if self.sweep is None or walked.truncated:
            return {}
        if not self._unseen_for_room(walked):
            self.sweep = None
            return {}
        return self._sweep_slice(walked)

    def _sweep_slice(self, walked: placement.Placement, budget: int | None = None
                     ) -> dict[tuple[str, int], str]:
        """The pending reasons of the running sweep's next slice (about `budget` tasks,
        SWEEP_TASKS by default), on the hosts as they are after this tick's commit: the
        jobs this tick's walk did not look at. A task found placeable gets none (the ticks
        place it or reach it)."""
        assert self.sweep is not None
        queue, state = self.pending_queue, self.state
        if state.pending_changes and self.queue_follows is state:
            # What left (this tick's assignments) or entered the pending tasks since the
            # walk, filed; the changes stay for the next tick's check whether it may be
            # skipped (filing them again there changes nothing).
            queue.apply(state.pending_changes, self._place_of)
        held = task_rules.held_back(state.backoff, time.time())
        held_jobs = {job_id for job_id, _ in held}
        # Small: a walk that stops short (while a sweep runs) looks at few.
        looked_at = {job_id for job_id, _ in walked.pending_reasons}
        looked_at.update(a.job_id for a in walked.assignments)
        units = [unit for job_id in self.sweep.take(
                     queue.indices, looked_at, lambda j: len(queue.tasks(j)),
                     sweep.SWEEP_TASKS if budget is None else budget)
                 if (unit := self._unit_of(job_id, held, held_jobs, keep=False)) is not None]
        if self.sweep.done:
            self.sweep = None
        else:
            self.wake.set()  # the next slice follows the pause
        if not units:
            return {}
        return placement.place(units, self._hosts(), index=self.host_index, limits=(
            state.limits, state.usage)).pending_reasons

    def _lowest_band_running(self) -> int:
        """The lowest band (highest rank) of any live attempt; -1 if none is live."""
        return max((rank for rank, n in self.state.live_by_rank.items() if n), default=-1)

    def _place_of(self, job_id: str) -> pending_queue.Place:
        return pending_queue.place_of(self.state.jobs[job_id])

    def _unit_template(self, job: JobView) -> tuple[queue_order.Waiting, placement.Unit]:
        """A job as the placement order sees it (with the charge of one task) and its unit,
        built once: its spec never changes."""
        cached = self.unit_templates.get(job.job_id)
        if cached is None:
            cached = self.unit_templates[job.job_id] = (queue_order.waiting(
                job, 1, self.settings.fair_share), _bare_unit(job))
        return cached

    def _hosts(self) -> list[placement.Host]:
        """The live workers as placement sees them (`host_index.listed()`): only the
        workers the fold changed since the last call are built again. placement.place puts
        back what it changes before it returns; preemption.plan works on copies."""
        state = self.state
        index = self.host_index
        if self.index_follows is not state or state.workers_changed is None:
            index = self.host_index = HostIndex()
            changed: Iterable[str] = state.workers
            self.index_follows = state
        else:
            changed = state.workers_changed
        hosts: dict[str, placement.Host | None] = {}
        for worker_id in changed:
            w = state.workers[worker_id]
            # A worker without devices has none to track one by one (None: placement then
            # need not look at its list on every call).
            hosts[worker_id] = placement.Host(
                w.worker_id, w.free, w.resources.device_kind, w.attributes, w.address,
                w.holder, frozenset(w.ports_used) if w.ports_used else placement.NO_PORTS,
                w.free_devices if w.devices else None, w.out_of_service,
                w.held_for) if w.alive else None
        if hosts:
            index.update(hosts)
        state.workers_changed = set()
        return index.listed()

    async def tick(self) -> int:
        """One round of placement; returns how many tasks it placed. Skipped (0) while
        nothing it would be given changed since a tick that placed nothing (idle_tick.py)."""
        self.placing_seconds = 0.0
        self.sweeping_seconds = 0.0
        self.skipped = False
        self.left_waiting = False
        if not self.state.pending:
            self.idle = None
            if self.state.holds:  # e.g. a preemptor cancelled while its victims stopped
                await self._let_go_of_holds(placement.Placement(), set())
            return 0
        started = time.perf_counter()
        hosts = self._hosts()
        if self.sweep is None and self._may_skip(hosts):
            self.skipped = True
            return 0
        self.idle = None
        with tracer.start_as_current_span("schedule.tick") as span:
            # Preemptors all of whose victims had stopped when this placement was computed
            # (more may stop while the tick awaits its commit: no verdict on those).
            settled = {job_id for job_id, hold in self.state.holds.items()
                       if all(self._exited(k) for k in hold.victims)}
            self.tick_limits_seq = self.state.limits.seq
            self._file_pending()
            stop_below = self._stop_below(time.time())
            result = placement.place(self._units(), hosts, limit=MAX_TICK_PLACEMENTS,
                                     limits=(self.state.limits, self.state.usage),
                                     stop_below=stop_below, index=self.host_index)
            self.placing_seconds = time.perf_counter() - started
            self.left_waiting = bool(result.truncated or self._unseen_for_room(result)
                                     or result.pending_reasons)
            span.set_attribute("berth.pending", len(self.state.pending))
            span.set_attribute("berth.placed", len(result.assignments))
            span.set_attribute("berth.walk_stopped", result.exhausted)
            span.set_attribute("berth.epoch", self.epoch)
            self._link_submits(span, result)
            if result.assignments and not await self._commit(result, span):
                return 0
            if result.truncated:
                self.wake.set()  # more may fit: the next tick follows the pause
            await self._let_go_of_holds(result, settled)
            preempted = await self._preempt(result)
            sweeping = time.perf_counter()
            swept = self._sweep_after(result)
            self.sweeping_seconds = time.perf_counter() - sweeping
            for reasons in (result.pending_reasons, swept):
                for key in reasons:
                    hold = self.state.holds.get(key[0])
                    if hold is not None and hold.reason:
                        reasons[key] = hold.reason
            await self._give_up_overdue(result.pending_reasons, swept)
            await self._announce(result.pending_reasons, swept)
            self._note_idle(hosts, result, preempted)
            return len(result.assignments)

    def _may_skip(self, hosts: list[placement.Host]) -> bool:
        """Whether a tick given `hosts` would surely place nothing (idle_tick.py)."""
        state = self.state
        changes = state.pending_changes
        return idle_tick.may_skip(self.idle, hosts, state.limits.seq,
                                  self.queue_follows is not state or changes is None
                                  or bool(changes), time.time())

    def _note_idle(self, hosts: list[placement.Host], result: placement.Placement,
                   preempted: bool) -> None:
        """Records a tick that placed, committed and preempted nothing: the ticks after it
        are skipped while what it was given stays the same."""
        if not (result.assignments or result.truncated or preempted
                or self.sweep is not None):
            # A walk stopped short, or with jobs left out, saw only some waiting tasks'
            # timeouts: skipped only until the next sweep (which sees the others) is due.
            swept = self.sweep_due if self._unseen_for_room(result) else idle_tick.NEVER
            self.idle = idle_tick.IdleTick(
                hosts, self.tick_limits_seq,
                min(self.backoff_due, self.overdue_due, self.reasons_due, swept))

    def _running(self) -> list[preemption.Running]:
        """Every live attempt not already being stopped, as preemption sees it."""
        out = []
        for worker in self._live_workers():
            for key, (job_id, index, attempt_id) in worker.live_attempts.items():
                job = self.state.jobs[job_id]
                attempt = job.tasks[index].attempt(attempt_id)
                if attempt is None or attempt.kill_requested or attempt.exited:
                    continue
                spec = job.spec
                out.append(preemption.Running(
                    key, job_id, worker.worker_id, spec.priority.rank, spec.resources.amounts,
                    spec.coscheduling is not None, spec.preemptible, attempt.assigned_at))
        return out

    async def _preempt(self, result: placement.Placement) -> bool:
        """Evicts lower-band attempts for units of a higher band this tick could not place
        (docs/placement.md, "Preemption"): each eviction and the hold of the hosts it frees
        for the preemptor is one fenced commit (preempt.lua), then logged; the victims are
        stopped by the fold's kills. Returns whether it committed or refused any (False:
        it found nothing to evict)."""
        # The lowest band running: a task may evict only below its band, a gang a
        # squatter of its own band too. Nothing to evict, nothing to plan (e.g. all work
        # of one band, however much of it waits): none of the waiting could evict if the
        # highest band filed could not (looking at each of 150,000 waiting jobs of one
        # band to find that took 0.3 s).
        lowest = self._lowest_band_running()
        queue = self.pending_queue
        top = queue.top_band()
        if lowest < 0 or top is None or not preemption.could_preempt(
                top, lowest, queue.gang_waits()):
            return False
        # A unit held back by a quota or a token would gain nothing from evictions.
        waiting = {job_id for job_id, _ in result.pending_reasons} - result.held_by_limits
        if not waiting:
            return False
        eligible = []
        for job_id in waiting:
            if job_id in self.state.holds:
                continue
            order, template = self._unit_template(self.state.jobs[job_id])
            band = order.band
            if preemption.could_preempt(band, lowest, template.gang is not None):
                eligible.append((self.queue_rank.get(job_id, len(self.queue_rank)), band,
                                 job_id))
        units = []
        for _, band, job_id in sorted(eligible):
            job = self.state.jobs[job_id]
            t = self._unit_template(job)[1]
            if t.gang is not None and any(x.state in ATTEMPT_LIVE for x in job.tasks):
                continue  # placed whole once none of it is live
            indices = tuple(x.index for x in job.tasks if x.key in self.state.pending)
            unit = placement.Unit(job_id, indices, t.need, t.device_kind, t.constraints,
                                  t.ports, t.gang)
            if unit.gang is not None:
                units.append((unit, band))
                continue
            # Each task of a job is planned on its own (each may need a different host).
            units += [(placement.Unit(unit.job_id, (i,), unit.need, unit.device_kind,
                                      unit.constraints, unit.ports), band)
                      for i in unit.indices if (unit.job_id, i) in result.pending_reasons]
            if len(units) >= MAX_TICK_PREEMPTIONS:
                break
        if not units:
            return False
        running = self._running()
        where = {r.key: r.worker_id for r in running}
        plans = preemption.plan(units, self._hosts(), running, limit=MAX_TICK_PREEMPTIONS)
        if not plans:
            return False
        evictions = [Eviction(p.job_id, p.hosts, tuple((where[k], k) for k in p.victims),
                              p.needs) for p in plans]
        self._check_lease()  # nothing committed that this term could not log
        # The whole tick's evictions in one call (W5: 100 gangs in one round trip instead
        # of 100), each still all or nothing.
        refusals = await self.store.preempt_many(self.epoch, evictions)
        committed: list[TasksPreempted] = []
        now = time.time()
        for p, why in zip(plans, refusals, strict=True):
            if why:
                log.error("preemption for %s refused (%s); re-reconciling with Redis",
                          p.job_id, why)
                continue
            committed.append(TasksPreempted(
                id=uuid.uuid4().hex, job_id=p.job_id, victims=list(p.victims),
                hosts=list(p.hosts), epoch=self.epoch, ts=now))
            log.info("%s preempts %d attempts of %s", p.job_id, len(p.victims),
                     ", ".join(p.victim_jobs))
        if committed:
            # Logged together (acks awaited at once); a term that ends before this leaves
            # holds only in Redis, which the next leader lets go (_reconcile).
            self._check_lease()
            await nats_io.publish_events(self.js, [nats_io.Outgoing(
                subjects.task_events(e.job_id), encode(e),
                nats_io.message_headers(f"preempt:{e.id}")) for e in committed])
            for event in committed:
                await self._carry_out(self.state.apply(0, event))
        if len(committed) < len(plans):
            await self._reconcile()
        return True

    async def _let_go_of_holds(self, result: placement.Placement, settled: set[str]) -> None:
        """Lets go of hosts held for a preemptor that no longer waits (it ended), or that
        this tick's placement could not place although every victim had stopped before it
        was computed (`settled`: the cluster changed): it may preempt afresh later."""
        tried = {job_id for job_id, _ in result.pending_reasons}
        for job_id, hold in list(self.state.holds.items()):
            job = self.state.jobs.get(job_id)
            if job is not None and any(t.key in self.state.pending for t in job.tasks):
                if job_id not in tried or job_id not in settled:
                    continue
                why = "could not be placed once its victims had stopped"
            else:
                why = "no longer waits for placement"
            await self.store.unhold(self.epoch, job_id, hold.hosts)
            event = PreemptionReleased(id=uuid.uuid4().hex, job_id=job_id,
                                       hosts=list(hold.hosts), epoch=self.epoch,
                                       ts=time.time(), reason=why)
            log.info("letting go of %d hosts held for %s: %s", len(hold.hosts), job_id, why)
            self._check_lease()
            await nats_io.publish_event(self.js, subjects.task_events(job_id), event,
                                        msg_id=f"unhold:{event.id}")
            self.state.apply(0, event)

    def _exited(self, key: str) -> bool:
        job_id, index, attempt_id = parse_attempt_key(key)
        task = self.state.task(job_id, index)
        attempt = task.attempt(attempt_id) if task is not None else None
        return attempt is None or attempt.exited

    def _link_submits(self, span: trace.Span, result: placement.Placement) -> None:
        """Links the tick to the submit of every job it placed or left waiting, so a job's
        trace leads to the ticks that considered it (nothing when the span is not recorded:
        reading each job's trace context was ~3 % of the scheduler's CPU at 600 jobs/s)."""
        if not span.is_recording():
            return
        placed = {a.job_id for a in result.assignments}
        # A span keeps at most 128 links (OTEL_SPAN_LINK_COUNT_LIMIT): the placed jobs
        # first, then those left waiting, in the order the tick considered them (taken
        # lazily: tens of thousands may wait).
        linked = sorted(placed)[:MAX_TICK_LINKS]
        seen = set(placed)
        for job_id, _ in result.pending_reasons if len(linked) < MAX_TICK_LINKS else ():
            if job_id not in seen:
                seen.add(job_id)
                linked.append(job_id)
                if len(linked) == MAX_TICK_LINKS:
                    break
        for job_id in linked:
            headers = telemetry.carrier_headers(self.trace_headers.get(job_id))
            if headers is None:
                continue
            submit = trace.get_current_span(telemetry.extract(headers)).get_span_context()
            span.add_link(submit, {"berth.job_id": job_id, "berth.placed": job_id in placed})

    async def _commit(self, result: placement.Placement, span: trace.Span) -> bool:
        """Reserves every placement of the tick in one fenced Lua call (the releases still
        owed go first, in the same round trip), then dispatches."""
        await self._flush_registrations()
        await self._sync_limits(self.tick_limits_seq)
        with tracer.start_as_current_span("reserve") as reserve_span:
            committed = await self._reserve(result, reserve_span)
        if committed is None:
            span.set_attribute("berth.outcome", "conflict")  # details on the reserve span
            return False
        for event in committed:
            self.state.apply(0, event)
        await self._dispatch(committed)
        return True

    async def _reserve(self, result: placement.Placement, span: trace.Span
                       ) -> list[TaskAssigned] | None:
        """The Lua commit of a tick's placements: the TaskAssigned events to log and
        dispatch, or None if Redis refused (the scheduler then resyncs with Redis)."""
        reservations = []
        events: list[TaskAssigned] = []
        now = time.time()
        for a in result.assignments:
            task = self.state.task(a.job_id, a.task_index)
            assert task is not None
            attempt_id = attempt_ids.next_id(task, self.ids_in_redis)
            worker = self.state.workers[a.worker_id]
            spec = self.state.jobs[a.job_id].spec
            res = spec.resources
            reservations.append(Reservation(
                a.worker_id, attempt_key(a.job_id, a.task_index, attempt_id), a.job_id,
                res.amounts, res.device_kind, tuple(a.ports.values()), a.group, worker.address,
                a.devices, spec.user, tuple(sorted(spec.tokens.items())),
            ))
            events.append(TaskAssigned(
                job_id=a.job_id, task_index=a.task_index, attempt_id=attempt_id,
                worker_id=a.worker_id, incarnation=worker.incarnation, epoch=self.epoch, ts=now,
                ports=a.ports, group=a.group, coordinator=a.coordinator, devices=list(a.devices),
                limits_seq=self.limits_synced,
            ))
        if span.is_recording():  # a sort of every host placed on, for a span that is kept
            span.set_attributes({
                "berth.epoch": self.epoch,
                "berth.reservations": len(reservations),
                "berth.hosts": sorted({r.worker_id for r in reservations}
                                      | {m for g in result.groups for m in g.members}),
                "berth.groups": [f"{g.name}:{g.job_id}" for g in result.groups],
            })
        try:
            await self._reserve_with_releases(reservations, result.groups)
        except ReservationConflict as exc:
            # Redis refuses what our view allowed: never write it; resync and retry.
            await self.store.count_refused_double_booking()
            scheduler_metrics.COMMIT_REFUSALS.labels("conflict").inc()
            span.set_attributes({"berth.outcome": "conflict", "berth.conflict": str(exc),
                                 "berth.refused_double_bookings": 1})
            log.error("reservation refused (%s); re-reconciling with Redis", exc)
            await self._reconcile()
            return None
        except StaleEpochError as exc:
            span.set_attributes({"berth.outcome": "stale_epoch", "berth.conflict": str(exc)})
            scheduler_metrics.COMMIT_REFUSALS.labels("stale_epoch").inc()
            raise
        span.set_attribute("berth.outcome", "ok")
        return events

    async def _reserve_with_releases(self, reservations: list[Reservation],
                                     groups: list[GroupClaim]) -> None:
        """The reservations, after the releases still owed, in one round trip: a commit
        soon after reports (one lone job after another) paid two. The releases stand even
        when the reservations are refused; on any other error they are owed still."""
        async with self._owed_releases() as (owed, through):
            await self.store.reserve(self.epoch, reservations, groups, releases=owed,
                                     released_through=through)

    async def _give_up_overdue(self, *unplaced: dict[tuple[str, int], str]) -> None:
        """Tasks this tick could not place (its walk's, its sweep slice's) whose
        scheduling_timeout has run out become UNSCHEDULABLE, with the last reason they
        could not be placed; notes when the next of the others' timeouts runs out."""
        now = time.time()
        self.overdue_due = idle_tick.NEVER
        for (job_id, index), reason in itertools.chain.from_iterable(
                part.items() for part in unplaced):
            job = self.state.jobs[job_id]
            limit = job.spec.scheduling_timeout
            if limit is None:
                continue
            task = job.tasks[index]
            if task.state != TaskState.PENDING:
                continue
            if now - task.pending_since < limit:
                self.overdue_due = min(self.overdue_due, task.pending_since + limit)
                continue
            event = TaskUnschedulable(
                job_id=job_id, task_index=index, epoch=self.epoch, ts=now,
                reason=bounded.clip(f"scheduling timeout of {limit:g}s expired: {reason}"),
                retries=task.retries,
            )
            log.info("task %s/%d reached its scheduling timeout: %s", job_id, index, event.reason)
            # A retry policy may make each timeout a retry: each is its own message.
            retried = f"/{task.retries}" if task.retries else ""
            await nats_io.publish_event(
                self.js, subjects.task_events(job_id), event,
                msg_id=f"unschedulable:{job_id}/{index}/{len(task.attempts)}{retried}",
            )
            # Applied at once so the next tick does not consider it; folding it again from
            # the stream is a no-op, so its effects are carried out exactly once.
            await self._carry_out(self.state.apply(0, event))

    async def _announce(self, walked: dict[tuple[str, int], str],
                        swept: dict[tuple[str, int], str]) -> None:
        """Announces the pending reasons of this tick's walk and sweep slice. A slice's
        tasks are not looked at again until the next sweep, so what it found is kept
        (`unannounced`) until an announcement is not held back by the interval, and the
        walk's reasons, newer, go over it. At most ANNOUNCED_AT_ONCE reasons are looked at
        per announcement; the rest wait for the next."""
        reasons = walked
        if swept or self.unannounced:
            self.unannounced.update(swept)
            self.unannounced.update(walked)
            reasons = self.unannounced
        batch = reasons if len(reasons) <= ANNOUNCED_AT_ONCE else dict(
            itertools.islice(reasons.items(), ANNOUNCED_AT_ONCE))
        if not await self._announce_pending_reasons(batch):
            return
        if batch is reasons:
            self.unannounced = {}
            return
        self.unannounced = reasons if reasons is self.unannounced else dict(reasons)
        for key in batch:
            del self.unannounced[key]
        self.reasons_due = time.time() + self.settings.pending_reason_interval

    async def _announce_pending_reasons(self, unplaced: dict[tuple[str, int], str]) -> bool:
        """Records why tasks wait in the event log (so the dashboard and `berth status` show
        it): only reasons that changed, at most once per BERTH_PENDING_REASON_INTERVAL.
        False if the interval held it back."""
        now = time.monotonic()
        self.reasons_due = idle_tick.NEVER
        wait = self.reasons_announced_at + self.settings.pending_reason_interval - now
        if wait > 0:
            self.reasons_due = time.time() + wait  # these may have changed: seen to then
            return False
        if self.state.last_seq >= self.reasons_in_flight_seq:
            self.reasons_in_flight.clear()
        changed: list[PendingReason] = []
        for (job_id, index), full_reason in unplaced.items():
            reason = bounded.clip(full_reason)
            task = self.state.jobs[job_id].tasks[index]
            if task.state != TaskState.PENDING or task.pending_reason == reason:
                continue
            if self.reasons_in_flight.get((job_id, index)) == reason:
                continue
            changed.append(PendingReason(job_id, index, reason))
        if not changed:
            return True
        self.reasons_announced_at = now
        self.reasons_in_flight = {(r.job_id, r.task_index): r.reason for r in changed}
        # In chunks under the message bound: with tens of thousands of pending tasks one
        # message would exceed NATS's max_payload (issue 21).
        ts, announcement = time.time(), uuid.uuid4().hex
        outgoing = [nats_io.Outgoing(
            subjects.PENDING_REASONS,
            encode(PendingReasonsChanged(reasons=chunk, epoch=self.epoch, ts=ts)),
            nats_io.message_headers(f"reasons:{self.epoch}:{announcement}:{n}"))
            for n, chunk in enumerate(bounded.chunks(changed, _encoded_size))]
        seqs = await nats_io.publish_events(self.js, outgoing)
        self.reasons_in_flight_seq = max(seqs)
        return True

    async def _dispatch(self, assigned: list[TaskAssigned]) -> None:
        """Logs a tick's assignments (their acks awaited together), then sends the run
        commands; each assignment has its own span under its job's submit trace, when
        spans are recorded (else the command carries the submit's trace context as it came:
        telemetry.recording)."""
        recording = telemetry.recording()
        spans = [tracer.start_span(
            "dispatch", context=telemetry.extract(
                telemetry.carrier_headers(self.trace_headers.get(event.job_id))),
            attributes={"berth.job_id": event.job_id, "berth.task_index": event.task_index,
                        "berth.worker_id": event.worker_id, "berth.epoch": event.epoch})
            for event in assigned] if recording else []
        outgoing = _assignment_messages(assigned, self.epoch)
        keys = {attempt_key(e.job_id, e.task_index, e.attempt_id) for e in assigned}
        try:
            self._check_lease()
            self.unlogged |= keys
            try:
                await nats_io.publish_events(self.js, outgoing)
            finally:
                self.unlogged -= keys
            for n, event in enumerate(assigned):
                task = self.state.task(event.job_id, event.task_index)
                assert task is not None
                worker = self.state.workers[event.worker_id]
                if recording:
                    with trace.use_span(spans[n]):
                        await self._send_run(worker, task, event.attempt_id)
                else:
                    await self._send_run(worker, task, event.attempt_id, headers=(
                        telemetry.carrier_headers(self.trace_headers.get(event.job_id))))
        finally:
            for span in spans:
                span.end()

    # --- worker commands ----------------------------------------------------------------

    async def _send(self, worker_id: str, command: Command,
                    headers: dict[str, str] | None = None) -> None:
        """`headers`: the trace context to send; by default, the current span's."""
        self._check_lease()
        if headers is None:
            headers = telemetry.inject({})
        try:
            await self.nc.publish(subjects.worker_commands(worker_id), encode(command),
                                  headers=headers)
        except nats.errors.MaxPayloadError as exc:
            # Bounded by construction (the spec is at most BERTH_MAX_SUBMIT_BYTES): a last
            # resort, never fatal. The heartbeat comparison re-sends or gives up on it.
            log.error("command %s for %s not sent: %s", type(command).__name__, worker_id, exc)

    async def _send_run(self, worker: WorkerView, task: TaskView, attempt_id: int,
                        headers: dict[str, str] | None = None) -> None:
        spec = self.state.jobs[task.job_id].spec
        attempt = task.attempt(attempt_id)
        assert attempt is not None
        env = {
            **spec.env,
            "BERTH_JOB_ID": task.job_id,
            "BERTH_TASK_INDEX": str(task.index),
            "BERTH_ATTEMPT_ID": str(attempt_id),
            "BERTH_NUM_TASKS": str(spec.replicas),
            # Earlier attempts that ended and were retried: failures, preemptions, resumes.
            "BERTH_RETRY_COUNT": str(task.failure_count + task.preemption_count
                                     + task.resume_count),
            "BERTH_HOST_ADDRESS": worker.address,
            **({"BERTH_PREEMPTION_GRACE": f"{spec.preemption_grace:g}"}
               if spec.preemption_grace is not None else {}),
            **{f"BERTH_PORT_{name.upper().replace('-', '_')}": str(port)
               for name, port in attempt.ports.items()},
        }
        if attempt.group:
            env["BERTH_GROUP"] = attempt.group
        if attempt.coordinator:
            env["BERTH_COORDINATOR_ADDRESS"] = attempt.coordinator
        # The spec's own values win: a user may rendezvous differently.
        env = {**frameworks.variables(spec, task.index, worker.address, attempt.ports,
                                      attempt.coordinator), **env}
        ids = {d.index: d.visible_id for d in worker.devices}
        await self._send(worker.worker_id, RunAttempt(
            epoch=self.epoch, incarnation=worker.incarnation, job_id=task.job_id,
            task_index=task.index, attempt_id=attempt_id, command=list(spec.command), env=env,
            resources=spec.resources, timeout=spec.timeout, bundle=spec.bundle,
            setup=list(spec.setup), build_timeout=spec.build_timeout,
            devices=[ids.get(i, str(i)) for i in attempt.devices],
        ), headers)

    async def _send_kill(self, kill: Kill) -> None:
        await self._send(kill.worker_id, KillAttempt(
            epoch=self.epoch, incarnation=kill.incarnation, job_id=kill.job_id,
            task_index=kill.task_index, attempt_id=kill.attempt_id, reason=kill.reason,
            grace=kill.grace,
        ))

    # --- heartbeats ---------------------------------------------------------------------

    def _on_heartbeat(self, msg: Msg) -> None:
        """In the reading task (nats_io.subscribe_now): one a second from every host, and
        most need no task of their own: a live worker with nothing to reconcile. Its answer
        goes out with the others of the same read (`_send_acks`); the rare heartbeat that
        calls for commands gets a task."""
        answer, work = self._hear(msg)
        if answer:
            self.acks.append(msg.reply)
            self.acks_queued.set()
        if work is not None:
            task = asyncio.create_task(self._as_leader(work))
            self.heartbeat_work.add(task)
            task.add_done_callback(self.heartbeat_work.discard)

    async def _heard(self, msg: Msg) -> None:
        """`_on_heartbeat`, awaited to its end (the answer included)."""
        answer, work = self._hear(msg)
        if answer:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(self.ack)
        if work is not None:
            await work

    @staticmethod
    async def _as_leader(work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except LostLeadership:
            pass  # past the lease, the lease task ends the term: nothing more is said
        except Exception:
            log.exception("acting on a heartbeat failed")

    async def _send_acks(self) -> None:
        """Answers the heartbeats `_on_heartbeat` heard, those of a read at a time."""
        while True:
            await self.acks_queued.wait()
            self.acks_queued.clear()
            replies, self.acks = self.acks, []
            if time.monotonic() >= self.lease_until:
                continue  # the lease is not surely ours now: no answer (see `_hear`)
            for reply in replies:
                with contextlib.suppress(nats.errors.Error):
                    await self.nc.publish(reply, self.ack)

    def _hear(self, msg: Msg) -> tuple[bool, Coroutine[Any, Any, None] | None]:
        """A heartbeat's bookkeeping: whether it is to be answered, and the commands it
        calls for (a coroutine to run), if any."""
        try:
            hb = read_heartbeat(msg.subject, msg.data)
        except RefusedEvent as exc:
            log.warning("heartbeat on %s refused: %s", msg.subject, exc)
            return False, None
        worker = self.state.workers.get(hb.worker_id)
        if worker is None or worker.incarnation != hb.incarnation:
            return False, None  # unknown, or a newer incarnation not folded yet
        if not worker.alive:
            # Declared dead, yet alive: its attempts were written off and their resources
            # given away, so it must stop them all and come back as a new incarnation.
            # Once per incarnation and D: after a long cut, each heartbeat it buffered
            # arrives at once (a lost reset is sent again after D).
            now = time.monotonic()
            last = self.resets_sent.get(hb.worker_id)
            if last is not None and last[0] == hb.incarnation and \
                    now - last[1] < self.settings.worker_dead_after:
                return False, None
            self.resets_sent[hb.worker_id] = (hb.incarnation, now)
            log.warning("worker %s declared dead is heartbeating; resetting it", hb.worker_id)
            return False, self._send(worker.worker_id, ResetWorker(
                epoch=self.epoch, incarnation=hb.incarnation,
                reason="this worker was declared dead; its attempts were rescheduled"))
        now = time.monotonic()
        self.last_heartbeat[hb.worker_id] = now
        # Heard: the worker's tasks may run on (its fence deadline moves). Only the leader
        # answers, only while its lease is surely its own, and only a live incarnation
        # (docs/reliability.md).
        answer = bool(msg.reply) and now < self.lease_until
        verdict = self._judge(worker, hb)
        if not (verdict.strays or verdict.unconfirmed_kills or verdict.lost_runs):
            return answer, None
        return answer, self._reconcile_worker(worker, verdict)

    def _judge(self, worker: WorkerView, hb: Heartbeat) -> heartbeats.Verdict:
        # As of when the worker listed its attempts, not when a busy leader reads the list.
        # Clamped: a worker clock running ahead only makes a harmless re-send come sooner,
        # one running far behind delays it by at most the dead-worker timeout.
        now = time.time()
        as_of = min(now, max(hb.ts, now - self.settings.worker_dead_after))
        return heartbeats.judge(self.state, worker, hb, as_of,
                                grace=2 * self.heartbeat_pace)

    async def _reconcile_worker(self, worker: WorkerView, verdict: heartbeats.Verdict) -> None:
        for job_id, index, attempt_id in verdict.strays:
            task = self.state.task(job_id, index)
            attempt = task.attempt(attempt_id) if task is not None else None
            # A preempted attempt keeps its grace, should its first kill have been lost.
            await self._send_kill(Kill(worker.worker_id, worker.incarnation, job_id,
                                       index, attempt_id, attempt.error if attempt and
                                       attempt.kill_grace is not None else "not a live attempt",
                                       attempt.kill_grace if attempt else None))
        for job_id, index, attempt_id in verdict.unconfirmed_kills:
            # Killed before it started: the worker confirms with a KILLED report (and will
            # refuse the run command from now on), which frees the reservation.
            await self._send_kill(Kill(worker.worker_id, worker.incarnation, job_id,
                                       index, attempt_id, "killed before it started"))
        for job_id, index, attempt_id in verdict.lost_runs:
            if attempt_key(job_id, index, attempt_id) in self.unlogged:
                continue  # not lost: its run command goes out once it is in the log
            log.info("re-sending lost assignment %s to %s",
                     attempt_key(job_id, index, attempt_id), worker.worker_id)
            task = self.state.task(job_id, index)
            assert task is not None
            await self._send_run(worker, task, attempt_id)

    async def _watch_workers(self) -> None:
        interval = self.settings.heartbeat_interval
        last_look = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - last_look > interval + self.settings.worker_dead_after / 2:
                # This process was paused (or starved), not the workers: their heartbeats
                # could not be heard, so restart every clock instead of declaring deaths.
                log.warning("scheduler stalled for %.1fs; restarting heartbeat clocks",
                            now - last_look)
                for worker in self._live_workers():
                    self.last_heartbeat[worker.worker_id] = now
            last_look = now
            live = self._live_workers()
            await self._pace_heartbeats(len(live))
            for worker in live:
                seen = self.last_heartbeat.setdefault(worker.worker_id, now)
                silent = now - seen
                if silent > self.settings.worker_dead_after:
                    await self._declare_dead(worker, silent)
                    self.last_heartbeat[worker.worker_id] = now
            await self._judge_node_health()

    async def _pace_heartbeats(self, live_workers: int) -> None:
        """Asks every worker for a slower heartbeat as the cluster grows, so the leader and
        the dashboard hear about BERTH_HEARTBEAT_RATE a second, not one per host per
        interval: in every answer to a heartbeat (which a real worker trusts), and in a
        broadcast (which simulated hosts heed)."""
        pace = heartbeats.pace(live_workers, self.settings.heartbeat_interval,
                               self.settings.heartbeat_rate,
                               self.settings.longest_heartbeat_interval)
        if pace == self.heartbeat_pace:
            return
        log.info("asking workers for a heartbeat every %g s (%d live workers, at most "
                 "BERTH_HEARTBEAT_RATE=%g a second)", pace, live_workers,
                 self.settings.heartbeat_rate)
        self.heartbeat_pace = pace
        self.ack = encode(HeartbeatAck(epoch=self.epoch, heartbeat_interval=pace))
        self._check_lease()
        await self.nc.publish(subjects.LEADER, encode(LeaderAnnouncement(
            epoch=self.epoch, scheduler_id=self.scheduler_id, heartbeat_interval=pace)))

    async def _judge_node_health(self) -> None:
        """Quarantines the hosts whose failures meet the policy, and preempts what still
        runs on a drained worker past its deadline (docs/operations.md, "Node health").
        Judged from the fold alone, so a new leader finishes what an old one began."""
        now = time.time()
        policy = self.settings.quarantine
        for worker in list(self.state.workers.values()):
            verdict: NodeHealthChanged | None = None
            msg_id = ""
            why = None
            if worker.quarantine is None and worker.failures:
                why = node_health.quarantine_reason(worker.failures, policy)
            if why is not None and not self._room_to_quarantine(worker.worker_id, why):
                why = None
            if why is not None:
                verdict = NodeHealthChanged(worker_id=worker.worker_id,
                                            action=NodeAction.QUARANTINE, reason=why,
                                            by="scheduler", epoch=self.epoch, ts=now)
                msg_id = f"quarantine:{worker.worker_id}:{worker.failures[-1].ts!r}"
            elif node_health.drain_overdue(
                    worker.drain_deadline if worker.draining else None, now) and any(
                    self._unstopped(job_id, index, attempt_id)
                    for job_id, index, attempt_id in worker.live_attempts.values()):
                verdict = NodeHealthChanged(worker_id=worker.worker_id,
                                            action=NodeAction.EVICT,
                                            reason="its drain deadline passed",
                                            by="scheduler", epoch=self.epoch, ts=now)
                msg_id = f"evict:{worker.worker_id}:{worker.drain_deadline!r}:{self.epoch}"
            if verdict is None:
                continue
            await self._renew_lease()
            log.warning("worker %s: %s (%s)", worker.worker_id, verdict.action.value,
                        verdict.reason)
            await nats_io.publish_event(self.js, subjects.worker_verdicts(worker.worker_id),
                                        verdict, msg_id=msg_id)
            # Applied at once, so no tick places on it meanwhile (folding it again from the
            # stream changes nothing).
            await self._carry_out(self.state.apply(0, verdict))

    def _room_to_quarantine(self, worker_id: str, why: str) -> bool:
        quarantined = sum(w.quarantine is not None for w in self.state.workers.values())
        if node_health.quarantine_room(quarantined, len(self.state.workers),
                                       self.settings.quarantine):
            return True
        if worker_id not in self.quarantine_refused:
            self.quarantine_refused.add(worker_id)
            log.warning("worker %s not quarantined (%s): %d of %d workers are already, the "
                        "most BERTH_QUARANTINE_MAX_SHARE allows", worker_id, why, quarantined,
                        len(self.state.workers))
        return False

    def _unstopped(self, job_id: str, index: int, attempt_id: int) -> bool:
        """Whether a live attempt has not been told to stop yet."""
        task = self.state.task(job_id, index)
        attempt = task.attempt(attempt_id) if task is not None else None
        return attempt is not None and not attempt.kill_requested

    async def _declare_dead(self, worker: WorkerView, silent: float) -> None:
        # Only a current leader may write a death off: a deposed one's event is void in the
        # fold anyway (epoch), but it should not even be published.
        await self._renew_lease()
        log.warning("worker %s silent for %.1fs: declaring it dead", worker.worker_id, silent)
        await nats_io.publish_event(
            self.js, subjects.worker_verdicts(worker.worker_id),
            WorkerDeclaredDead(worker_id=worker.worker_id, incarnation=worker.incarnation,
                               reason=f"no heartbeat for {silent:.1f}s", epoch=self.epoch,
                               ts=time.time()),
            msg_id=f"dead:{worker.worker_id}:{worker.incarnation}",
        )


async def bus_answers(js: JetStreamContext) -> bool:
    """One round trip through NATS to the events stream (a request its timeout bounds; a
    PING flush is not used: nats-py's reader dies on a PONG that comes after a timeout)."""
    try:
        await js.get_last_msg(subjects.EVENTS_STREAM, subjects.LEADER_EVENTS)
    except nats.js.errors.NotFoundError:
        return True  # answered: no leader yet
    except (nats.errors.Error, TimeoutError, OSError):
        return False
    return True


async def run(settings: Settings, stop: asyncio.Event) -> None:
    scheduler_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    redis_settings = RedisSettings.from_env(settings.redis_url)
    try:
        redis = redis_io.open_client(redis_settings)
    except redis_io.RedisConfigError as exc:
        raise SystemExit(f"berth scheduler: {exc}") from None
    nc = await nats_io.connect_service(settings, f"berth-scheduler-{scheduler_id}",
                                      Role.SCHEDULER)
    await nats_io.ensure_streams(nc.jetstream(), settings.stream_replicas)
    store = ReservationStore(redis, redis_settings.wait_replicas, redis_settings.wait_timeout)
    term = scheduler_metrics.Term()
    refresh = scheduler_metrics.instrument(term, nc.jetstream(), store)
    serving = await metrics.serve(settings.metrics_host, settings.metrics_port, [refresh])
    log.info("scheduler %s started; waiting for the leader lease", scheduler_id)
    take_over = settings.lease_ttl * 4 / 3 + 1.0
    if settings.fence_after < take_over:
        log.warning("workers fence their tasks %.1f s after the last acknowledged heartbeat, "
                    "sooner than a leader take-over can take (about %.1f s): a take-over "
                    "will cost a retry of every running task (docs/reliability.md)",
                    settings.fence_after, take_over)
    warm = warm_fold.WarmFold(_snapshot_path(settings), settings.snapshot_interval,
                               settings.fair_share.half_life)
    try:
        await _stand_for_leader(settings, nc, store, scheduler_id, stop, term, warm)
    except NoPermissionError as exc:
        raise SystemExit(f"berth scheduler: Redis refused a command ({exc}); the user in "
                         "BERTH_REDIS_URL needs the scheduler's ACL (docs/redis.md)") from None
    finally:
        await warm.close()
        if serving is not None:
            await serving.stop()
        await nats_io.close(nc)
        await redis.aclose()


def _snapshot_path(settings: Settings) -> Path | None:
    """Where this scheduler keeps its fold's snapshot: in its data dir, which one scheduler
    at a time may use (a second one on the same dir goes without, saying so once)."""
    data_dir = Path(settings.data_dir)
    try:
        # Held for the process's life; the kernel drops it when the process ends.
        dir_lock.acquire(data_dir / "scheduler.lock", "scheduler")
    except (dir_lock.DirLocked, OSError) as exc:
        log.warning("no scheduler snapshot: %s", exc)
        return None
    return data_dir / "scheduler" / "fold.snapshot"


def _encoded_size(reason: PendingReason | TaskAssigned) -> int:
    return len(encode(reason)) + 1  # and its comma


def _assignment_messages(assigned: list[TaskAssigned], epoch: int) -> list[nats_io.Outgoing]:
    """A tick's assignments as events-stream messages: one `task_assigned` on its job's
    subject when the tick placed one task (a lone submit's path stays as it was), else
    `tasks_assigned` batches under the message bound: one message for every reader to
    fold instead of one per task (docs/performance.md). A batch's id is its first
    attempt key's in this term, so a re-published batch is a duplicate to JetStream."""
    if len(assigned) == 1:
        event = assigned[0]
        key = attempt_key(event.job_id, event.task_index, event.attempt_id)
        return [nats_io.Outgoing(subjects.task_events(event.job_id), encode(event),
                                 nats_io.message_headers(f"assign:{epoch}:{key}"))]
    out = []
    for chunk in bounded.chunks(assigned, _encoded_size):
        first = attempt_key(chunk[0].job_id, chunk[0].task_index, chunk[0].attempt_id)
        out.append(nats_io.Outgoing(
            subjects.ASSIGNMENTS, encode(TasksAssigned(epoch=epoch, assignments=chunk,
                                                       ts=chunk[0].ts)),
            nats_io.message_headers(f"assigns:{epoch}:{first}")))
    return out


async def _stand_for_leader(settings: Settings, nc: NATS, store: ReservationStore,
                            scheduler_id: str, stop: asyncio.Event,
                            term: scheduler_metrics.Term | None = None,
                            warm: warm_fold.WarmFold | None = None) -> None:
    """Leads whenever this scheduler holds the lease, stands by otherwise. Redis being
    unreachable (or a write no replica acknowledged) ends a term like a lost lease does;
    the lease is then retried with backoff until Redis, or the primary Sentinel promotes,
    answers again."""
    ttl_ms = int(settings.lease_ttl * 1000)
    js = nc.jetstream()
    ping_js = nc.jetstream(timeout=settings.lease_ttl / 2)
    backoff = fencing.Backoff()
    outage = fencing.Outage("Redis")
    folded = 0  # the highest epoch an earlier term of this process saw in the log
    warm = warm or warm_fold.WarmFold(None, settings.snapshot_interval,
                                     settings.fair_share.half_life)
    while not stop.is_set():
        # Only a scheduler NATS answers may take the lease.
        bus_ok_at = time.monotonic()
        if not await bus_answers(ping_js):
            log.warning("NATS does not answer; not taking the lease")
            await service.wait_or_stop(stop, settings.lease_ttl / 3)
            continue
        try:
            lease = await fencing.take_lease(store, js, scheduler_id, ttl_ms, folded)
        except (*redis_io.UNREACHABLE, NotDurable) as exc:
            outage.failed(exc)
            await redis_io.ask_again(store.client)
            await service.wait_or_stop(stop, backoff.next())
            continue
        except nats_io.RETRIABLE as exc:
            log.warning("reading the newest epoch from the event log failed (%s); retrying",
                        exc)
            await service.wait_or_stop(stop, backoff.next())
            continue
        outage.recovered()
        backoff.reset()
        if lease is None:
            # Another leads: keep the fold warm meanwhile. Not before the lease was asked
            # for: a follower catching up on a long log fills the one NATS connection, and
            # the new term's first round trips (its election, the hand-over) waited behind
            # it past a short lease (tests/test_leadership.py).
            warm.stand_by(js)
            # Standbys poll a little out of step with each other.
            await service.wait_or_stop(stop, settings.lease_ttl / 3 * random.uniform(0.8, 1.2))
            continue
        leader = Leader(settings, nc, store, scheduler_id, lease, bus_ok_at,
                        state_from=lambda: warm.hand_over(js))
        term = term or scheduler_metrics.Term()
        term.leader = leader
        scheduler_metrics.TERMS.inc()
        try:
            await leader.serve(stop)
        except (LostLeadership, StaleEpochError, NotDurable, ReservationConflict,
                fencing.Superseded) as exc:
            scheduler_metrics.term_ended(exc)
            # Every Redis write is fenced: a refused epoch anywhere ends the term.
            log.warning("lost leadership: %s; standing by", exc)
            if isinstance(exc, NotDurable):
                await redis_io.ask_again(store.client)
        except redis_io.UNREACHABLE as exc:
            scheduler_metrics.term_ended(exc)
            # No write can be fenced now, so nothing is placed until the lease is won again.
            outage.failed(exc, "standing down")
            await redis_io.ask_again(store.client)
            await service.wait_or_stop(stop, backoff.next())
        except nats_io.RETRIABLE as exc:
            # E.g. JetStream answering 503 while a NATS cluster re-elects after a partition:
            # it once ended both schedulers (exit 1), and nothing led again.
            log.warning("lost leadership: NATS failed (%s: %s); standing by",
                        type(exc).__name__, exc)
            await service.wait_or_stop(stop, backoff.next())
        finally:
            term.leader = None
            term.folded_earlier += leader.folded
            folded = max(folded, leader.state.epoch)
            # The term's fold is not kept (warm_fold.end_term says why); unless the term
            # ended before the warm fold was handed to it, which then is still the
            # standby's own (or, handed over halfway, empty: folded again from the snapshot).
            if leader.state_from is None:
                warm.end_term()


def main() -> None:
    settings = Settings.from_env()
    service.run("scheduler", lambda stop: run(settings, stop))
