"""One batch from a JetStream pull consumer, read as nats-py's `fetch` reads it but without a
timed wait per message.

nats-py's `PullSubscription.fetch(n)` awaits `next_msg(timeout)` once for each of the n
messages, and each of those is an `asyncio.wait_for`: a task and a timer per message, about a
quarter of a catching-up dashboard's CPU per event (docs/performance.md). Here the messages
already delivered are taken from the subscription's queue without waiting, and a timed wait
happens only when the queue is empty: once per burst of the socket, not per message.

The protocol is nats-py's: first a `no_wait` request (the server sends what it has, then a
404 status if that was less than the batch); if that brought nothing, one request that
lingers up to `wait` for the first message. It reads nats-py's private members (the
subscription's queue and the request subject); with a nats-py that lacks them, it falls back
to nats-py's own `fetch`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

# The statuses that end a pull request without an error (nats-py's "temporary" ones).
_REQUEST_OVER = (api.StatusCode.NO_MESSAGES, api.StatusCode.REQUEST_TIMEOUT,
                 api.StatusCode.CONFLICT)


def _internals(psub: JetStreamContext.PullSubscription) -> tuple[Any, asyncio.Queue[Msg],
                                                                   str, str] | None:
    try:
        sub = psub._sub
        return sub, sub._pending_queue, psub._nms, psub._deliver
    except AttributeError:
        return None


async def fetch(psub: JetStreamContext.PullSubscription, batch: int,
                wait: float) -> list[Msg]:
    """Up to `batch` messages: those the stream has now, or else the first to arrive within
    `wait` seconds and any that came with it. Raises TimeoutError when none came, and
    nats-py's APIError for a status that is not the end of a request (a deleted consumer)."""
    inside = _internals(psub)
    if inside is None:
        return await psub.fetch(batch, timeout=wait)
    sub, queue, request_subject, inbox = inside
    # Messages of an earlier request that outlived its fetch are taken first.
    msgs: list[Msg] = []
    _take_queued(sub, queue, msgs, batch)
    if len(msgs) >= batch:
        return msgs
    loop = asyncio.get_running_loop()
    for lingering in (False, True):
        if lingering and msgs:
            return msgs
        request: dict[str, Any] = {"batch": batch - len(msgs)}
        if lingering:
            request["expires"] = int(wait * 1e9)
        else:
            request["no_wait"] = True
        await psub._nc.publish(request_subject, json.dumps(request).encode(), inbox)
        deadline = loop.time() + wait
        while len(msgs) < batch:
            if queue.empty():
                if lingering and msgs:
                    return msgs  # the first came: do not wait for the batch to fill
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(left):  # in this task: no task per wait
                        msg = await queue.get()
                except TimeoutError:
                    break
            else:
                msg = queue.get_nowait()
            sub._pending_size -= len(msg.data)
            status = JetStreamContext.is_status_msg(msg)
            if not status:
                msgs.append(msg)
            elif status in _REQUEST_OVER:
                if lingering:
                    # Perhaps the end of an earlier fetch's request, which outlived it (its
                    # expiry came after that fetch stopped waiting): this one's own ends at
                    # the deadline, which the wait above keeps.
                    continue
                break
            elif status != api.StatusCode.CONTROL_MESSAGE:  # an idle heartbeat: skipped
                raise nats.js.errors.APIError.from_msg(msg)
    if not msgs:
        raise TimeoutError
    return msgs


def _take_queued(sub: Any, queue: asyncio.Queue[Msg], msgs: list[Msg], batch: int) -> None:
    while len(msgs) < batch and not queue.empty():
        msg = queue.get_nowait()
        sub._pending_size -= len(msg.data)
        if not JetStreamContext.is_status_msg(msg):
            msgs.append(msg)
