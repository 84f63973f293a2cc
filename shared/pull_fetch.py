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
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from berth.shared import nats_io

T = TypeVar("T")

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
    return await PullReader(psub, _as_is).fetch(batch, wait)


def _as_is(msg: Msg) -> Msg:
    return msg


# A data message as `Client.take_pull` hands it over (subject, reply, payload, raw headers),
# made into a reader's item; None: not one this reader takes (nats-py queues it).
MakeItem = Callable[[bytes, bytes, bytes, bytes | None], T | None]


class PullReader(Generic[T]):
    """Batches from one pull subscription, each message made into an item of type `T`:
    by `convert` from nats-py's `Msg`, or, given `make` and berth's client, by `make` from
    the message as the client reads it (`nats_io.Client.take_pull`), without a `Msg`, its
    headers parsed, or nats-py's queue (a third of a catching-up dashboard's CPU per
    event, docs/performance.md). Status messages still go through nats-py's queue, read
    here after the data taken before them, so the batches are the same either way.
    `close()` before unsubscribing. With a nats-py that lacks the members read here, it
    reads through nats-py's own `fetch`."""

    def __init__(self, psub: JetStreamContext.PullSubscription, convert: Callable[[Msg], T],
                 make: MakeItem[T] | None = None) -> None:
        self._psub = psub
        self._inside = _internals(psub)
        if self._inside is not None:
            self._sub, self._queue, self._request_subject, self._inbox = self._inside
        self._convert = convert
        self._make = make
        self._taken: list[T] = []
        self._waiter: asyncio.Future[None] | None = None  # the fetch waiting for a message
        client = psub._nc
        self._client = client if make is not None and self._inside is not None \
            and nats_io.TAKES_STREAMS and isinstance(client, nats_io.Client) else None
        if self._client is not None:
            self._client.take_pull(self._sub, self)

    @property
    def taking(self) -> bool:
        """Whether the client hands this reader its data messages as it reads them."""
        return self._client is not None

    def take(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> bool:
        assert self._make is not None
        item = self._make(subject, reply, data, headers)
        if item is None:
            return False
        self._taken.append(item)
        if self._waiter is not None:
            self.queued()
        return True

    def queued(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        if self._client is not None:
            self._client.release_pull(self._sub)
            self._client = None

    async def fetch(self, batch: int, wait: float) -> list[T]:
        """As the module's `fetch`, in items."""
        if self._inside is None:
            return [self._convert(msg) for msg in await self._psub.fetch(batch, timeout=wait)]
        # Messages of an earlier request that outlived its fetch are taken first.
        items: list[T] = []
        self._take_ready(items, batch, None)
        if len(items) >= batch:
            return items
        loop = asyncio.get_running_loop()
        for lingering in (False, True):
            if lingering and items:
                return items
            request: dict[str, Any] = {"batch": batch - len(items)}
            if lingering:
                request["expires"] = int(wait * 1e9)
            else:
                request["no_wait"] = True
            await self._psub._nc.publish(self._request_subject, json.dumps(request).encode(),
                                         self._inbox)
            deadline = loop.time() + wait
            while len(items) < batch:
                if self._take_ready(items, batch, lingering):
                    break  # the server ended the request
                if len(items) >= batch:
                    break
                if lingering and items:
                    return items  # the first came: do not wait for the batch to fill
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(left):  # in this task: no task per wait
                        if self._client is not None:
                            self._waiter = loop.create_future()
                            try:
                                await self._waiter
                            finally:
                                self._waiter = None
                        else:
                            msg = await self._queue.get()
                            if self._read_queued(msg, items, lingering):
                                break
                except TimeoutError:
                    break
        if not items:
            raise TimeoutError
        return items

    def _take_ready(self, items: list[T], batch: int, lingering: bool | None) -> bool:
        """Moves what has arrived into `items`, in order (what was taken, then the queue:
        a message is taken only while the queue is empty, so every one queued is newer),
        up to `batch`. True: a status ended this request. `lingering` None: no request of
        this fetch is out yet, so statuses are of earlier ones and skipped."""
        taken = self._taken
        if taken:
            room = batch - len(items)
            items.extend(taken[:room])
            del taken[:room]
        while len(items) < batch and not self._queue.empty():
            if self._read_queued(self._queue.get_nowait(), items, lingering):
                return True
        return False

    def _read_queued(self, msg: Msg, items: list[T], lingering: bool | None) -> bool:
        self._sub._pending_size -= len(msg.data)
        status = JetStreamContext.is_status_msg(msg)
        if not status:
            items.append(self._convert(msg))
        elif lingering is None or status == api.StatusCode.CONTROL_MESSAGE:
            pass  # an earlier request's end, or an idle heartbeat
        elif status in _REQUEST_OVER:
            # Lingering: perhaps the end of an earlier fetch's request, which outlived it
            # (its expiry came after that fetch stopped waiting): this one's own ends at the
            # deadline, which the wait keeps.
            return not lingering
        else:
            raise nats.js.errors.APIError.from_msg(msg)
        return False
