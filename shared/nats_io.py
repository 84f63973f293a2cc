"""NATS JetStream plumbing: connecting, creating streams idempotently, publishing with
dedup ids and trace context, and reading the events stream in order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError

from shared import subjects, telemetry
from shared.messages import AnyEvent, encode, event_decoder

log = logging.getLogger(__name__)

DAY = 24 * 3600.0

STREAMS = [
    StreamConfig(
        name=subjects.SUBMIT_STREAM,
        subjects=[subjects.SUBMIT_ALL],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=7 * DAY,
        duplicate_window=600.0,
        discard=DiscardPolicy.OLD,
    ),
    StreamConfig(
        name=subjects.EVENTS_STREAM,
        subjects=[subjects.EVENTS_ALL],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        # The events stream is the source of truth: it is never aged out here.
        duplicate_window=600.0,
        discard=DiscardPolicy.NEW,
    ),
    StreamConfig(
        name=subjects.LOGS_STREAM,
        subjects=[subjects.LOGS_ALL],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=7 * DAY,
        max_bytes=2 * 1024**3,
        discard=DiscardPolicy.OLD,
    ),
]


async def connect(url: str, name: str) -> NATS:
    async def on_error(exc: Exception) -> None:
        log.warning("nats: %s", exc)

    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        error_cb=on_error,
    )


async def ensure_streams(js: JetStreamContext) -> None:
    """Creates every stream, or updates it to this config; safe to call from every service."""
    for config in STREAMS:
        try:
            await js.add_stream(config=config)
        except BadRequestError:
            await js.update_stream(config=config)


def message_headers(msg_id: str) -> dict[str, str]:
    return telemetry.inject({"Nats-Msg-Id": msg_id})


async def publish_event(
    js: JetStreamContext, subject: str, event: msgspec.Struct, msg_id: str, attempts: int = 0
) -> int:
    """Publishes one event with a dedup id; retries while NATS is unreachable so a
    state change is never dropped (attempts=0: retry forever). Returns the stream sequence."""
    payload = encode(event)
    tries = 0
    while True:
        tries += 1
        try:
            ack = await js.publish(
                subject, payload, headers=message_headers(msg_id), stream=subjects.EVENTS_STREAM
            )
            return int(ack.seq)
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError,
                nats.js.errors.NoStreamResponseError) as exc:
            if attempts and tries >= attempts:
                raise
            log.warning("publish to %s failed (%s), retrying", subject, exc)
            await asyncio.sleep(min(0.1 * tries, 2.0))


@dataclass
class EventRecord:
    seq: int
    event: AnyEvent
    headers: dict[str, str]


@dataclass
class RawEvent:
    """An events-stream message as stored: its sequence, JSON bytes and headers."""

    seq: int
    data: bytes
    headers: dict[str, str]


def raw_event(msg: Msg) -> RawEvent:
    return RawEvent(msg.metadata.sequence.stream, msg.data, dict(msg.headers or {}))


async def follow_raw_events(
    js: JetStreamContext, start_seq: int = 1, filter_subject: str = subjects.EVENTS_ALL
) -> AsyncGenerator[RawEvent]:
    """Yields every events-stream message from `start_seq` on, in stream order, forever (an
    ordered consumer: the client detects gaps and re-creates it, so nothing is skipped)."""
    sub = await js.subscribe(
        filter_subject,
        stream=subjects.EVENTS_STREAM,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        config=ConsumerConfig(opt_start_seq=start_seq, ack_policy=AckPolicy.NONE),
        idle_heartbeat=5.0,
        pending_msgs_limit=1_000_000,
    )
    try:
        async for msg in sub.messages:
            yield raw_event(msg)
    finally:
        # The connection may be closing under a cancelled reader: nothing left to undo.
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


async def follow_events(
    js: JetStreamContext,
    start_seq: int = 1,
    filter_subject: str = subjects.EVENTS_ALL,
    on_bad: Callable[[int, Exception], None] | None = None,
) -> AsyncGenerator[EventRecord]:
    """Every event from `start_seq` on, decoded, in stream order, forever."""
    async for raw in follow_raw_events(js, start_seq, filter_subject):
        try:
            event = event_decoder.decode(raw.data)
        except msgspec.DecodeError as exc:
            # An event we cannot read is logged and skipped, never fatal.
            if on_bad:
                on_bad(raw.seq, exc)
            log.error("event %d is unreadable: %s", raw.seq, exc)
            continue
        yield EventRecord(seq=raw.seq, event=event, headers=raw.headers)


async def last_event_seq(js: JetStreamContext) -> int:
    info = await js.stream_info(subjects.EVENTS_STREAM)
    return int(info.state.last_seq)


async def read_subject(js: JetStreamContext, stream: str, subject: str) -> list[Msg]:
    """Every message currently stored on one subject, oldest first."""
    info = await js.stream_info(stream, subjects_filter=subject)
    if not info.state.subjects or subject not in info.state.subjects:
        return []
    sub = await js.subscribe(
        subject, stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    out: list[Msg] = []
    try:
        while True:
            msg = await sub.next_msg(timeout=5.0)
            out.append(msg)
            if msg.metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()


async def close(nc: NATS, timeout: float = 5.0) -> None:
    """Drains (flushing what is pending) but never hangs a shutdown on it."""
    try:
        await asyncio.wait_for(nc.drain(), timeout)
    except (TimeoutError, nats.errors.Error) as exc:
        log.debug("drain did not finish (%s); closing", exc)
    finally:
        if not nc.is_closed:
            await nc.close()
