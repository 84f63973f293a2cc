"""The dashboard's ClusterState, folded from the events stream through a durable consumer,
saved as a snapshot so a restart continues instead of starting over, plus the recent
events (for live updates) and worker heartbeats (not events: liveness only)."""

from __future__ import annotations

import asyncio
import bisect
import logging
import secrets
import time
from collections import deque
from pathlib import Path

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from berth.services.dashboard_api import timeline
from berth.shared import nats_io, service, state_snapshot, subjects
from berth.shared.durable_feed import DurableEventFeed
from berth.shared.event_origin import RefusedEvent, read_heartbeat
from berth.shared.lifecycle import AttemptView, ClusterState, JobView
from berth.shared.messages import (
    AttemptReported,
    DeviceStats,
    JobsCompacted,
    JobSubmitted,
    TaskAssigned,
    TasksAssigned,
)
from berth.shared.nats_io import RawEvent
from berth.shared.usage import FairShare

log = logging.getLogger("berth.dashboard.projection")

CONSUMER_PREFIX = "berth-dashboard-"
# While the stream is busy, a batch of events folded at most every this many seconds (after
# a quiet spell, the first at once): at 2,000 jobs a second, batches of a few events each
# had a pull request and an ack round trip apiece, a fifth of the dashboard's CPU
# (docs/performance.md). What a page or a submit's answer waits for it is at most this.
# 50 ms, not 20: a sixth less of the dashboard's CPU again under W1, and placements ran
# faster for it on 2 cores (docs/performance.md, docs/decisions.md).
LIVE_FOLD_PACE = 0.05


def consumer_name(state_dir: Path | None) -> str:
    """This dashboard's own durable consumer: any number of dashboards follow the log at
    once, each with its own (one shared name would split the messages between them). The
    name is kept with the dashboard's state, so a restart resumes the same consumer; one
    that no dashboard reads any more is removed by the server (CONSUMER_IDLE_LIMIT)."""
    path = state_dir / "consumer" if state_dir is not None else None
    if path is not None and path.exists():
        name = path.read_text().strip()
        if name.startswith(CONSUMER_PREFIX):
            return name
    name = CONSUMER_PREFIX + secrets.token_hex(4)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name + "\n")
    return name


class Projection:
    def __init__(
        self,
        nc: NATS,
        worker_dead_after: float,
        snapshot_path: Path | None = None,
        snapshot_interval: float = 30.0,
        recent_events: int = 10_000,
        fair_share: FairShare | None = None,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.fair_share = fair_share = fair_share or FairShare()
        self.state = ClusterState(fair_share.half_life)
        self.last_heartbeat: dict[str, float] = {}
        # Each worker's GPUs' figures from its latest heartbeat (not events: not folded).
        self.device_stats: dict[str, list[DeviceStats]] = {}
        self.worker_dead_after = worker_dead_after
        self.snapshot_path = snapshot_path
        self.snapshot_interval = snapshot_interval
        # Every folded event's JSON, newest last, for live updates (seq, data or None when
        # the event was unreadable).
        self.recent: deque[tuple[int, bytes | None]] = deque(maxlen=recent_events)
        self.changed = asyncio.Condition()
        self.caught_up = asyncio.Event()
        # Jobs in submission order (their submit sequences alongside), for paging.
        self.job_order: list[JobView] = []
        self.job_order_seqs: list[int] = []
        # For the host timeline: each worker's attempts by assignment, and the cluster's
        # counts as they stood (event time), sampled as batches fold.
        self.host_attempts: dict[str, deque[timeline.HostAttempt]] = {}
        self.cluster_samples: deque[timeline.ClusterPoint] = deque(
            maxlen=timeline.CLUSTER_HISTORY)
        self.consumer = consumer_name(snapshot_path.parent if snapshot_path else None)
        self._feed = DurableEventFeed(self.js, self.consumer, pace=LIVE_FOLD_PACE)
        self._saved_seq = 0
        self._last_ts = 0.0  # the newest folded event's time
        self._sampled_at = -timeline.SAMPLE_EVERY  # when the last cluster sample was taken
        self._sample_timer: asyncio.TimerHandle | None = None
        self.folded = 0  # events folded by this process (a metric)
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self.stream, self._catch_up_to = await nats_io.events_stream_identity(self.js)
        self._load_snapshot()
        if self.state.last_seq >= self._catch_up_to:
            self.caught_up.set()
        # In the reading task: one a second from every host (nats_io.subscribe_now).
        await nats_io.subscribe_now(self.nc, subjects.HEARTBEATS_ALL, self._on_heartbeat)
        self._tasks = [asyncio.create_task(self._follow()),
                       asyncio.create_task(self._save_periodically())]

    async def stop(self) -> None:
        if self._sample_timer is not None:
            self._sample_timer.cancel()
        # Until they end (a dropped cancellation, service.cancel_and_wait, held the stop
        # until its deadline, and the snapshot below was never saved).
        await service.cancel_and_wait(self._tasks)
        await self.save_snapshot()

    # --- folding --------------------------------------------------------------------------

    async def _follow(self) -> None:
        while True:
            try:
                await self._fold_batches()
            except (TimeoutError, nats.errors.Error) as exc:
                # NATS slow or away for a moment (an ack unanswered on a loaded machine):
                # one line, and on from where the state stands.
                log.warning("folding the events stream paused (%s: %s); resuming in 1 s",
                            type(exc).__name__, exc)
                await asyncio.sleep(1.0)
            except Exception:
                # The projection must never stop silently: say why, and go on from where
                # the state stands.
                log.exception("folding the events stream failed; resuming in 1 s")
                await asyncio.sleep(1.0)

    async def _fold_batches(self) -> None:
        async for batch in self._feed.batches(self.state.last_seq):
            for raw in batch:
                self._apply(raw)
            self.folded += len(batch)
            self._sample_cluster()
            await self._feed.ack()
            if not self.caught_up.is_set() and self.state.last_seq >= self._catch_up_to:
                log.info("caught up at event %d", self.state.last_seq)
                self.caught_up.set()
            async with self.changed:
                self.changed.notify_all()

    def _apply(self, raw: RawEvent) -> None:
        # A refused message is counted by the fold and never shown: the rest still folds.
        event = raw.event()
        state = self.state
        if event is None:
            state.apply(raw.seq, event)
            self.recent.append((raw.seq, None))
            return
        if isinstance(event, AttemptReported):  # most events: nothing of the projection's own
            state.apply(raw.seq, event)
        elif isinstance(event, (TaskAssigned, TasksAssigned)):
            made: list[tuple[JobView, int, AttemptView]] = []
            state.new_attempts = made  # only assignments make attempts
            try:
                state.apply(raw.seq, event)
            finally:
                state.new_attempts = None
            for job, task_index, attempt in made:
                timeline.index_attempt(self.host_attempts, job, task_index, attempt)
        elif isinstance(event, JobSubmitted):
            known = len(state.jobs)
            state.apply(raw.seq, event)
            if len(state.jobs) != known:
                self._index_job(state.jobs[event.job_id])
        elif isinstance(event, JobsCompacted):
            state.apply(raw.seq, event)
            self._unindex(set(event.job_ids))
        else:
            state.apply(raw.seq, event)
        # Services stamp their own events: the chart's clock never runs backwards.
        if event.ts > self._last_ts:
            self._last_ts = event.ts
        self.recent.append((raw.seq, raw.data))

    def _sample_cluster(self) -> None:
        # A sample walks every worker: at most one a second of folding, however many
        # batches (a rebuild from sequence 1 samples its history that coarsely). One held
        # back is taken when the second is up, so the state before a quiet spell is kept.
        wait = self._sampled_at + timeline.SAMPLE_EVERY - time.monotonic()
        if wait <= 0:
            self._take_sample()
        elif self._sample_timer is None:
            self._sample_timer = asyncio.get_running_loop().call_later(wait, self._take_sample)

    def _take_sample(self) -> None:
        # Runs between two batches (a loop callback), so it sees one consistent state.
        self._sample_timer = None
        self._sampled_at = time.monotonic()
        if (point := self.cluster_now()) is not None:
            timeline.record_point(self.cluster_samples, point)

    def cluster_now(self) -> timeline.ClusterPoint | None:
        """The cluster as it stands, as of the newest event; None before any."""
        return timeline.cluster_point(self.state, self._last_ts) if self._last_ts else None

    async def fold_to_head(self, timeout: float) -> None:
        """Waits, at most `timeout` seconds, until every event the stream holds now is
        folded: what a client was just told from the stream (a submit's outcome, a job
        id) is then shown here, not a 404 for a job folded a moment later (the live fold
        takes a batch at most every LIVE_FOLD_PACE)."""
        deadline = time.monotonic() + timeout
        try:
            info = await asyncio.wait_for(self.js.stream_info(subjects.EVENTS_STREAM), timeout)
        except (TimeoutError, nats.errors.Error):
            return  # NATS slow or away: what is folded is what is shown
        head = info.state.last_seq
        while self.state.last_seq < head and (left := deadline - time.monotonic()) > 0:
            await self.wait_for_change(left)

    async def wait_for_change(self, timeout: float) -> bool:
        """Waits until more events are folded; False if `timeout` passed first."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait(), timeout)
            except TimeoutError:
                return False
            return True

    def _index_job(self, job: JobView) -> None:
        self.job_order.append(job)
        self.job_order_seqs.append(job.submit_seq)

    def _unindex(self, job_ids: set[str]) -> None:
        """Compacted jobs (docs/retention.md) leave the job list and the host timeline."""
        kept = [job for job in self.job_order if job.job_id not in job_ids]
        if len(kept) != len(self.job_order):
            self.job_order = kept
            self.job_order_seqs = [job.submit_seq for job in kept]
        for worker_id, entries in self.host_attempts.items():
            if any(e.job_id in job_ids for e in entries):
                self.host_attempts[worker_id] = deque(
                    (e for e in entries if e.job_id not in job_ids), maxlen=entries.maxlen)

    def jobs_before(self, submit_seq: int | None) -> range:
        """Indexes into job_order, newest first, of jobs submitted before `submit_seq`."""
        end = (len(self.job_order_seqs) if submit_seq is None
               else bisect.bisect_left(self.job_order_seqs, submit_seq))
        return range(end - 1, -1, -1)

    # --- snapshots ------------------------------------------------------------------------

    def _load_snapshot(self) -> None:
        if self.snapshot_path is None or not self.snapshot_path.exists():
            return
        try:
            self.state = state_snapshot.load(self.snapshot_path.read_bytes(), self.stream,
                                             self._catch_up_to, self.fair_share.half_life)
        except state_snapshot.UnusableSnapshot as exc:
            log.warning("snapshot %s not used (%s): rebuilding from the first event",
                        self.snapshot_path, exc)
            return
        for job in sorted(self.state.jobs.values(), key=lambda j: j.submit_seq):
            self._index_job(job)
        self.host_attempts = timeline.build_index(self.state)
        self._saved_seq = self.state.last_seq
        log.info("snapshot loaded: %d jobs, %d workers, up to event %d",
                 len(self.state.jobs), len(self.state.workers), self.state.last_seq)

    async def save_snapshot(self) -> None:
        if self.snapshot_path is None or self.state.last_seq == self._saved_seq:
            return
        # Encoded here, between two folds, so it is one consistent state; written by a
        # thread, then renamed into place so a crash never leaves half a snapshot.
        seq = self.state.last_seq
        try:
            data = state_snapshot.dump(self.state, self.stream)
        except (OverflowError, ValueError, TypeError) as exc:
            # An event the fold believed carried what msgpack cannot hold (an admin may write
            # an integer past 2**64: found by the fault suite's fuzz). The snapshot only
            # saves a start its fold: go on without it, and say so once per new state.
            log.error("cannot encode a snapshot up to event %d (%s); not saved", seq, exc)
            self._saved_seq = seq
            return
        try:
            await asyncio.to_thread(state_snapshot.write_atomically, self.snapshot_path, data)
        except OSError as exc:  # kept in memory; a start without it rebuilds from the stream
            log.error("cannot save snapshot %s: %s", self.snapshot_path, exc)
            return
        self._saved_seq = seq
        log.debug("snapshot saved up to event %d (%d bytes)", seq, len(data))

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval)
            await self.save_snapshot()

    # --- heartbeats -----------------------------------------------------------------------

    def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = read_heartbeat(msg.subject, msg.data)
        except RefusedEvent:
            return
        self.last_heartbeat[hb.worker_id] = hb.ts
        self.device_stats[hb.worker_id] = hb.devices

    def worker_healthy(self, worker_id: str) -> bool:
        worker = self.state.workers.get(worker_id)
        seen = self.last_heartbeat.get(worker_id)
        return bool(worker and worker.alive and seen
                    and time.time() - seen < self.worker_dead_after)

