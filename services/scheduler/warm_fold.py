"""The fold a scheduler keeps while it stands by, so that winning the lease costs folding
only the events since, not the whole history; saved as a snapshot in the data dir (while
standing by, after a term and on a clean stop) so a restarted scheduler starts warm too.

Trusted for one thing only: a start for the fold. The fold is a pure function of the log,
and a snapshot is the fold of the log up to its last_seq (same stream, same FORMAT), so
loading it and folding the rest gives what folding from sequence 1 gives (tested). It
grants nothing: the leader still folds up to its own leader_elected, reconciles Redis and
the workers from the result, and every Redis write is still fenced by the lease's epoch.
A snapshot that is unreadable, of another stream or ahead of the stream is dropped with
one log line, and the fold starts from sequence 1 as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import nats.errors
from nats.js import JetStreamContext

from berth.shared import nats_io, service, state_snapshot
from berth.shared.lifecycle import ClusterState
from berth.shared.usage import FairShare

log = logging.getLogger("berth.scheduler")

RETRY_AFTER = 1.0  # seconds before following again after NATS failed


class WarmFold:
    def __init__(self, path: Path | None, save_interval: float,
                 usage_half_life: float = FairShare.half_life) -> None:
        self.path = path
        self.save_interval = save_interval
        # The fold's own setting: a snapshot folded with another is not continued.
        self.usage_half_life = usage_half_life
        self.state = self._empty()
        # The events stream the state was folded from ("" before it was asked).
        self.stream = ""
        self._saved_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._spoiled = False  # the fold raised: what it holds may be half an event
        self._handed_over = False

    def _empty(self) -> ClusterState:
        return ClusterState(self.usage_half_life)

    # --- standing by ----------------------------------------------------------------------

    def stand_by(self, js: JetStreamContext) -> None:
        """Starts following the stream (loading the snapshot first if nothing is folded)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._follow(js), name="warm-fold")

    async def hand_over(self, js: JetStreamContext) -> ClusterState:
        """Stops following and gives the fold to a new leader: what it has folded if it
        still belongs to the events stream, else an empty state (a fold from sequence 1)."""
        await self._stop_following()
        if self.state.last_seq == 0 and not self._spoiled:
            # Never stood by (the lease was free at once): start from the snapshot file.
            with contextlib.suppress(*nats_io.RETRIABLE):
                await self._check_stream(js)
        state, self.state = self.state, self._empty()
        self._handed_over = True  # nothing to save until the term gives its fold back
        try:
            return await self._checked(js, state)
        except asyncio.CancelledError:
            # The term ended before it had the fold: standing by again starts afresh (from
            # the snapshot file), and saves again.
            self._handed_over = False
            raise

    async def _checked(self, js: JetStreamContext, state: ClusterState) -> ClusterState:
        if self._spoiled:
            self._spoiled = False
            return self._empty()
        if state.last_seq == 0:
            return state
        try:
            stream, last = await nats_io.events_stream_identity(js)
        except nats_io.RETRIABLE as exc:
            log.warning("cannot check the warm fold's stream (%s): folding from the first "
                        "event", exc)
            return self._empty()
        if stream != self.stream or state.last_seq > last:
            log.warning("the warm fold (up to event %d of %s) is not of the events stream "
                        "now (%s, up to %d): folding from the first event", state.last_seq,
                        self.stream, stream, last)
            return self._empty()
        return state

    def end_term(self) -> None:
        """After a term: its fold is NOT taken back. A leader applies its own assignments
        to its fold as it commits them, before the log has them, and a publish may never
        land (its term ended first): taken back, such a fold was ahead of the log, and the
        next term never placed 25 tasks it believed assigned (tests/test_nats_cluster.py's
        burst, once). Standing by again starts from the snapshot file, which holds only
        what was folded from the log, and folds the rest."""
        self.state = self._empty()
        self._handed_over = False

    async def close(self) -> None:
        await self._stop_following()
        await self.save()

    async def _stop_following(self) -> None:
        if self._task is not None:
            # Cancelled until it ends: its stream checks are nats-py requests, which can
            # drop a cancellation (service.cancel_and_wait), and a take-over waits here.
            await service.cancel_and_wait([self._task])
            self._task = None

    async def _follow(self, js: JetStreamContext) -> None:
        while True:
            try:
                await self._check_stream(js)
                await self._fold(js)
            except (*nats_io.RETRIABLE, nats.errors.Error, OSError) as exc:
                log.info("standby's fold paused: NATS failed (%s); following again", exc)
                await asyncio.sleep(RETRY_AFTER)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A fold that raised leaves no state to trust; the leader folds from 1.
                log.exception("standby's fold failed; a take-over will fold from the first "
                              "event")
                self._spoiled = True
                return

    async def _check_stream(self, js: JetStreamContext) -> None:
        stream, last = await nats_io.events_stream_identity(js)
        if self.stream and (stream != self.stream or self.state.last_seq > last):
            log.warning("the events stream is now %s (was %s): folding it from the first "
                        "event", stream, self.stream)
            self.state = self._empty()
        self.stream = stream
        if self.state.last_seq == 0:
            self._load(stream, last)

    def _load(self, stream: str, last: int) -> None:
        if self.path is None or not self.path.exists():
            return
        started = time.monotonic()
        try:
            self.state = state_snapshot.load(self.path.read_bytes(), stream, last,
                                             self.usage_half_life)
        except (state_snapshot.UnusableSnapshot, OSError) as exc:
            log.warning("scheduler snapshot %s not used (%s): folding from the first event",
                        self.path, exc)
            return
        self._saved_seq = self.state.last_seq
        log.info("scheduler snapshot loaded in %.2f s: %d jobs, %d workers, up to event %d",
                 time.monotonic() - started, len(self.state.jobs), len(self.state.workers),
                 self.state.last_seq)

    async def _fold(self, js: JetStreamContext) -> None:
        next_save = time.monotonic() + self.save_interval
        events = nats_io.follow_events(js, self.state.last_seq + 1)
        try:
            async for record in events:
                # Synchronous: a cancel lands between two events, never inside one.
                self.state.apply(record.seq, record.event)
                if time.monotonic() >= next_save:
                    await self.save()
                    next_save = time.monotonic() + self.save_interval
        finally:
            await events.aclose()

    # --- the snapshot file ----------------------------------------------------------------

    async def save(self) -> None:
        if (self.path is None or not self.stream or self._handed_over or self._spoiled
                or self.state.last_seq in (0, self._saved_seq)):
            return
        seq = self.state.last_seq
        try:
            # Encoded here, between two folds: one consistent state.
            data = state_snapshot.dump(self.state, self.stream)
        except (OverflowError, ValueError, TypeError) as exc:
            log.error("cannot encode a scheduler snapshot up to event %d (%s); not saved",
                      seq, exc)
            self._saved_seq = seq
            return
        try:
            await asyncio.to_thread(state_snapshot.write_atomically, self.path, data)
        except OSError as exc:
            log.error("cannot save scheduler snapshot %s: %s", self.path, exc)
            return
        self._saved_seq = seq
        log.debug("scheduler snapshot saved up to event %d (%d bytes)", seq, len(data))
