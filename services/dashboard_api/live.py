"""Streams for clients that watch: Server-Sent Events of the events stream (ids are stream
sequences, so a client that reconnects with Last-Event-ID misses nothing), and a task
attempt's log, followed until the attempt has exited."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import AsyncGenerator, Callable

import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from berth.services.dashboard_api.projection import Projection
from berth.shared import nats_io, subjects

RETRY_MS = 2000


def sse_frame(seq: int, data: bytes) -> bytes:
    # msgspec writes JSON on one line, so one data: field carries it whole.
    return b"id: %d\ndata: %s\n\n" % (seq, data)


async def sse_events(projection: Projection, after_seq: int,
                     shown: Callable[[bytes], bytes | None],
                     keepalive: float = 15.0) -> AsyncGenerator[bytes]:
    """Every event after `after_seq`, as SSE frames, then each new one as it is folded. An
    event is sent only once the projection has folded it, so a client that fetches the API
    on an event sees that event's effect. `shown` is the event as this client may see it
    (None: not at all)."""
    yield b"retry: %d\n\n" % RETRY_MS
    next_seq = after_seq + 1
    recent = projection.recent
    while True:
        oldest = recent[0][0] if recent else projection.state.last_seq + 1
        if next_seq < oldest:
            # Older than the memory window: read that stretch from the stream itself.
            async for raw in nats_io.follow_raw_events(projection.js, next_seq):
                if (data := shown(raw.data)) is not None:
                    yield sse_frame(raw.seq, data)
                next_seq = raw.seq + 1
                if next_seq >= oldest:
                    break
            continue
        if next_seq <= projection.state.last_seq:
            start = bisect.bisect_left(recent, next_seq, key=lambda item: item[0])
            for seq, folded in list(itertools.islice(recent, start, None)):
                if folded is not None and (data := shown(folded)) is not None:
                    yield sse_frame(seq, data)
                next_seq = seq + 1
            continue
        if not await projection.wait_for_change(keepalive):
            yield b": keepalive\n\n"


def of_stream(msg: Msg, stream: str | None) -> bool:
    """Whether an attempt_logs message is output of `stream` (None: of any)."""
    return stream is None or (msg.headers or {}).get(subjects.LOG_STREAM_HEADER) == stream


async def follow_log(js: JetStreamContext, subject: str, exited: Callable[[], bool],
                     after_seq: int | None = None, quiet_after_exit: float = 1.0,
                     stream: str | None = None) -> AsyncGenerator[bytes]:
    """The attempt's output (after stream sequence `after_seq`, or all of it; only
    `stream`'s if given), then as it is written; ends once the attempt has exited and its
    last output has had `quiet_after_exit` seconds to arrive."""
    policy, config = ((DeliverPolicy.ALL, None) if after_seq is None else
                      (DeliverPolicy.BY_START_SEQUENCE,
                       ConsumerConfig(opt_start_seq=after_seq + 1)))
    sub = await js.subscribe(subject, stream=subjects.LOGS_STREAM, ordered_consumer=True,
                             deliver_policy=policy, config=config)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=quiet_after_exit)
            except nats.errors.TimeoutError:
                if exited():
                    return
                continue
            if of_stream(msg, stream):
                yield msg.data
    finally:
        await sub.unsubscribe()


def tail_lines(text: str, lines: int) -> str:
    if lines <= 0:
        return ""
    kept = text.splitlines(keepends=True)[-lines:]
    return "".join(kept)
