"""The leader's compaction of finished jobs out of the events stream (docs/retention.md):
first the JobsCompacted record, so every reader drops those jobs when it gets there,
then the purges of what only they used. Which jobs and which messages is decided in
shared/retention.py; this carries it out, renewing the lease before each batch so a
deposed leader stops at the next one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from berth.shared import retention, subjects
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    CompactReply,
    CompactRequest,
    JobsCompacted,
    decode,
    encode,
)
from berth.shared.nats_io import publish_event

log = logging.getLogger("berth.scheduler")

PURGE_TRIES = 5

_request_decoder = msgspec.json.Decoder(CompactRequest)


class Compactor:
    """One per term: `renew` raises if the lease is no longer this leader's; `apply` folds
    an event of this leader's own at once (and carries out what it yields)."""

    def __init__(self, js: JetStreamContext, state: Callable[[], ClusterState], epoch: int,
                 renew: Callable[[], Awaitable[None]],
                 apply: Callable[[JobsCompacted], Awaitable[None]]) -> None:
        self.js = js
        self.state = state
        self.epoch = epoch
        self.renew = renew
        self.apply = apply
        # One compaction at a time: the periodic one and an operator's ask the same fold.
        self.lock = asyncio.Lock()

    async def compact(self, older_than: float, now: float | None = None) -> CompactReply:
        async with self.lock:
            before = await self.js.stream_info(subjects.EVENTS_STREAM)
            state = self.state()
            job_ids = retention.compactable(state, time.time() if now is None else now,
                                            older_than)
            for batch in retention.batches(job_ids):
                await self._compact_batch(batch)
            if job_ids:
                await self._purge_shared(retention.shared_subjects_watermark(self.state()))
            after = await self.js.stream_info(subjects.EVENTS_STREAM)
        if job_ids:
            log.info("compacted %d finished jobs: events stream %d -> %d messages, %d -> %d "
                     "bytes", len(job_ids), before.state.messages, after.state.messages,
                     before.state.bytes, after.state.bytes)
        return CompactReply(jobs=len(job_ids),
                            messages_before=before.state.messages,
                            messages_after=after.state.messages,
                            bytes_before=before.state.bytes, bytes_after=after.state.bytes)

    async def _compact_batch(self, batch: list[str]) -> None:
        outcomes = retention.outcome_seqs(self.state(), batch)
        await self.renew()
        event = JobsCompacted(job_ids=batch, epoch=self.epoch, ts=time.time())
        # Logged before anything is purged: a reader that folded a job's submit and then
        # finds its later events gone still drops it here, never keeps it as pending.
        await publish_event(self.js, subjects.JOBS_COMPACTED, event,
                            msg_id=f"compact:{self.epoch}:{batch[0]}:{batch[-1]}")
        await self.apply(event)
        # The submits first: a reader replaying from here on never meets the job at all.
        # Each step's purges go out together: one wait per batch, not a round trip each.
        await self._purge([subjects.submit_outcome_any_user(seq) for seq in outcomes])
        await self._purge([subjects.task_events(job_id) for job_id in batch])

    async def _purge(self, filters: list[str]) -> None:
        await asyncio.gather(*(self._purge_one(f) for f in filters))

    async def _purge_one(self, subject: str, seq: int | None = None) -> None:
        """Retried a while: a job whose record is logged is dropped from every fold, so a
        purge given up on leaves its messages in the stream for good (harmless, but
        unbounded)."""
        for attempt in range(PURGE_TRIES):
            try:
                await self.js.purge_stream(subjects.EVENTS_STREAM, seq=seq, subject=subject)
                return
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                if attempt == PURGE_TRIES - 1:
                    raise
                log.warning("purging %s failed (%s); trying again", subject, exc)
                await asyncio.sleep(0.5 * (attempt + 1))

    async def _purge_shared(self, below: int) -> None:
        if below <= 1:
            return
        await self.renew()
        for subject in (subjects.ATTEMPT_REPORTS_ALL, subjects.ASSIGNMENTS,
                        subjects.PENDING_REASONS):
            await self._purge_one(subject, seq=below)

    async def run(self, retention_period: float) -> None:
        """Compacts what has been finished for the retention period, now and then."""
        while True:
            await asyncio.sleep(retention.check_interval(retention_period))
            try:
                await self.compact(retention_period)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                # NATS trouble is no reason to give up the lease; a lost lease still ends
                # the term (renew raises something else).
                log.warning("compaction failed (%s); trying again in the next round", exc)

    async def on_request(self, msg: Msg) -> None:
        """An operator's `berth admin compact`: compacts at once, answers what it did."""
        try:
            request = decode(_request_decoder, msg.data)
        except msgspec.DecodeError as exc:
            await msg.respond(encode(CompactReply(error=f"invalid compact request: {exc}")))
            return
        try:
            reply = await self.compact(request.older_than)
        except Exception as exc:
            log.warning("compaction asked for failed: %s", exc)
            reply = CompactReply(error=f"compaction failed: {exc}")
        await msg.respond(encode(reply))
