"""The events stream read through a named durable JetStream consumer, strictly in order.

The consumer's position lives on the NATS server (`nats consumer info EVENTS <name>` shows
how far its reader got). A reader that resumes with the state it saved at sequence S binds
to the consumer if the consumer stands exactly at S with nothing in flight; otherwise (a
crash left deliveries unacknowledged, or the state is older) it re-creates the consumer to
deliver from S+1. Either way the reader sees every event after S once, in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from berth.shared import pacing, subjects
from berth.shared.nats_io import RawEvent, ack_reply_tokens, raw_event, wire_event
from berth.shared.pull_fetch import PullReader

# An event as read, with the reply subject that acknowledges it (and, the consumer
# acknowledging all, every event before it).
Pulled = tuple[RawEvent, str]

log = logging.getLogger(__name__)

CONSUMER_IDLE_LIMIT = 24 * 3600.0
ACK_TIMEOUT = 1.0  # nats-py's for `Msg.ack_sync`
# How long a pull request lingers on the server for the first event of a quiet stream. The
# event is handed over the moment it comes, so this is not a latency: it is how often an
# idle reader asks again (two requests and their two status replies each time). At 0.1 s
# that was a third of an idle dashboard's CPU with 100 hosts, a sixth with 1,000, and some
# of nats-server's (docs/performance.md). Requests that outlive their fetch are read by
# the next; at most one is left per fetch, for at most this long (a paced reader: 50), far
# below the server's 512 waiting requests per consumer.
FETCH_WAIT = 1.0


def _pulled(msg: Msg) -> Pulled:
    return raw_event(msg), msg.reply


def _taken(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> Pulled | None:
    """An event as the client reads it; None for a reply of another form than
    "$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...." (nats-py reads those)."""
    tokens = ack_reply_tokens(reply)
    if tokens is None:
        return None
    return wire_event(int(tokens[5]), subject, data, headers), reply.decode()


class DurableEventFeed:
    def __init__(self, js: JetStreamContext, name: str, batch: int = 5000,
                 fetch_wait: float = FETCH_WAIT, pace: float = 0.0) -> None:
        # A fetch (shared/pull_fetch.py) returns what the stream has at once; with nothing
        # there, it waits up to `fetch_wait` for the first event and returns it with what
        # came along, without waiting for the batch to fill.
        self.js = js
        self.name = name
        self.batch = batch
        self.fetch_wait = fetch_wait
        # After a batch short of `batch` (caught up), the next fetch waits until `pace`
        # seconds after it (shared/pacing.py): a live follower of a busy stream then takes
        # a batch per `pace`, with one pull request and one ack each, instead of a few
        # events per batch. After a quiet spell the first event is not held.
        self.pace = pace
        self.resumed = False  # the last open bound to the consumer as it stood
        self._sub: JetStreamContext.PullSubscription | None = None
        self._reader: PullReader[Pulled] | None = None
        self._unacked = ""  # the reply subject of the last event passed on, if not acked

    async def open(self, after_seq: int) -> None:
        try:
            info = await self.js.consumer_info(subjects.EVENTS_STREAM, self.name)
        except NotFoundError:
            info = None
        self.resumed = bool(
            info is not None
            and info.ack_floor is not None and info.delivered is not None
            and info.ack_floor.stream_seq == after_seq
            and info.delivered.stream_seq == after_seq
            and not info.num_ack_pending
        )
        if not self.resumed:
            if info is not None:
                await self.js.delete_consumer(subjects.EVENTS_STREAM, self.name)
            await self.js.add_consumer(subjects.EVENTS_STREAM, ConsumerConfig(
                durable_name=self.name,
                description="the dashboard's projection of the events stream",
                filter_subject=subjects.EVENTS_ALL,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=after_seq + 1,
                # Acknowledging a message acknowledges everything before it.
                ack_policy=AckPolicy.ALL,
                ack_wait=60.0,
                max_ack_pending=self.batch * 4,
                # A consumer no one has read for this long is the server's to remove (a
                # dashboard that went away for good).
                inactive_threshold=CONSUMER_IDLE_LIMIT,
            ))
        self._sub = await self.js.pull_subscribe_bind(self.name, stream=subjects.EVENTS_STREAM)
        self._reader = PullReader(self._sub, _pulled, _taken)
        self._unacked = ""
        log.info("events consumer %s %s after sequence %d", self.name,
                 "resumed" if self.resumed else "created", after_seq)

    async def batches(self, after_seq: int) -> AsyncGenerator[list[RawEvent]]:
        """Batches of the events after `after_seq`, in order, forever. Call `ack()` once a
        batch is applied."""
        await self._reopen(after_seq)  # retried: a dashboard may start during an election
        expected = after_seq + 1
        reopened_at: int | None = None
        loop = asyncio.get_running_loop()
        short_at: float | None = None  # when the last batch short of `batch` came
        while True:
            assert self._reader is not None
            if short_at is not None:
                now = loop.time()
                if (wait := pacing.next_at(now, short_at, self.pace) - now) > 0:
                    await asyncio.sleep(wait)
            try:
                pulled = await self._reader.fetch(self.batch, self.fetch_wait)
            except TimeoutError:  # nothing new (nats-py raises the builtin one too)
                continue
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("events consumer %s: %s; reopening after %d", self.name, exc,
                            expected - 1)
                await asyncio.sleep(0.5)
                await self._reopen(expected - 1)
                continue
            short_at = loop.time() if len(pulled) < self.batch else None
            batch: list[RawEvent] = []
            for raw, reply in pulled:
                seq = raw.seq
                if seq < expected:
                    continue  # a redelivery of something already passed on
                if seq > expected and await self._purged(expected, seq):
                    pass  # compacted out of the stream (docs/retention.md): nothing is due
                elif seq > expected and reopened_at != expected:
                    # Out of order (an earlier delivery is still due) or missing from the
                    # stream: read again from the expected sequence, once.
                    reopened_at = expected
                    await self._reopen(expected - 1)
                    break
                elif seq > expected:
                    log.warning("events %d..%d are not in the stream; going on", expected,
                                seq - 1)
                batch.append(raw)
                self._unacked = reply
                expected = seq + 1
            if batch:
                yield batch

    async def _purged(self, first: int, delivered: int) -> bool:
        """Whether the stream holds nothing from `first` up to the `delivered` sequence: a
        gap compaction purged, not a delivery still due. One direct read; on any doubt,
        False (the caller reads again from `first`)."""
        try:
            msg = await self.js.get_msg(subjects.EVENTS_STREAM, seq=first,
                                        subject=subjects.EVENTS_ALL, next=True)
        except (nats.errors.Error, nats.js.errors.Error):
            return False
        return msg.seq is not None and msg.seq >= delivered

    async def ack(self) -> None:
        if self._unacked:
            # Confirmed by the server (one round trip per batch), so the position is known
            # when a clean stop saves the state beside it. As nats-py's `Msg.ack_sync` (an
            # empty request: an acknowledgement).
            await self.js._nc.request(self._unacked, timeout=ACK_TIMEOUT)
            self._unacked = ""

    async def _reopen(self, after_seq: int) -> None:
        while True:
            try:
                if self._reader is not None:
                    self._reader.close()
                if self._sub is not None:
                    await self._sub.unsubscribe()
            except nats.errors.Error:
                pass
            try:
                await self.open(after_seq)
                return
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                log.warning("events consumer %s: reopen failed (%s)", self.name, exc)
                await asyncio.sleep(1.0)
