"""JetStream's replies to the events berth publishes, matched to their publishes in the
client's read loop (`nats_io.Client.publish_stored`).

nats-py's `publish_async` takes each reply through a `Msg`, its subscription's queue and
task, `json.loads` and a `PubAck` dataclass, and each publish through a semaphore and
`secrets.token_hex` (a system call): about a sixth of py-spy's samples in the simulated
hosts and in the submitter (docs/performance.md). It also never settles a publish that
JetStream refuses with an error reply: `APIError.from_error` raises inside its callback,
so the publish waits out its timeout and is sent again, whatever the error. Here a reply
settles its publish with the stream sequence, or with the exception nats-py's own
`JetStreamContext.publish` raises for the same reply (`nats_io.publish_events` retries
those, as it did after the timeout).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

# A status line instead of headers: the server found no stream for the subject.
_NO_RESPONDERS = b"NATS/1.0 503"


class _Reply(msgspec.Struct):
    """What berth reads of JetStream's reply to a publish: `{"stream": ..., "seq": N,
    "duplicate": true?}`, or `{"error": {"code": ..., "err_code": ..., "description": ...}}`."""

    seq: int = 0
    error: dict[str, Any] | None = None


_decode_reply = msgspec.json.Decoder(_Reply).decode
_API_ERROR_FIELDS = frozenset(
    inspect.signature(nats.js.errors.APIError.__init__).parameters) - {"self"}


class UnreadableReply(nats.errors.Error):
    """A reply to a publish that is not JetStream's: whether it was stored is unknown."""


def refusal(error: dict[str, Any]) -> nats.js.errors.APIError:
    """The exception nats-py raises for this error reply (`APIError.from_error` raises it),
    made of the fields nats-py knows (a newer server may send more)."""
    known = {k: v for k, v in error.items() if k in _API_ERROR_FIELDS}
    known.setdefault("code", None)
    try:
        made: object = nats.js.errors.APIError.from_error(known)
    except nats.js.errors.APIError as exc:
        return exc
    # A nats-py whose from_error returns the error instead.
    return made if isinstance(made, nats.js.errors.APIError) else \
        nats.js.errors.APIError(**known)


def settle(future: asyncio.Future[int], headers: bytes | None, data: bytes) -> None:
    """Settles a publish's future from JetStream's reply to it."""
    if future.done():
        return  # its publisher stopped waiting
    if headers is not None and headers.startswith(_NO_RESPONDERS):
        future.set_exception(nats.js.errors.NoStreamResponseError())
        return
    try:
        reply = _decode_reply(data)
    except msgspec.DecodeError as exc:
        future.set_exception(UnreadableReply(f"unreadable reply to a publish: {exc}"))
        return
    if reply.error is not None:
        future.set_exception(refusal(reply.error))
    elif reply.seq < 1:  # a stream's sequences start at 1: not JetStream's answer
        future.set_exception(UnreadableReply(f"a reply to a publish with no sequence: {data!r}"))
    else:
        future.set_result(reply.seq)


class PendingAcks:
    """The publishes awaiting JetStream's reply, by the token that ends their reply subject.
    A publish whose publisher stops waiting (its future cancelled) is forgotten."""

    def __init__(self) -> None:
        self._waiting: dict[bytes, asyncio.Future[int]] = {}
        self._tokens = itertools.count(1)

    def expect(self) -> tuple[bytes, asyncio.Future[int]]:
        """A new token and the future its reply settles."""
        token = b"%x" % next(self._tokens)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiting = self._waiting
        waiting[token] = future
        future.add_done_callback(lambda _: waiting.pop(token, None))
        return token, future

    def take(self, token: bytes, headers: bytes | None, data: bytes) -> None:
        """A reply: it settles its publish, if that still waits."""
        future = self._waiting.pop(token, None)
        if future is not None:
            settle(future, headers, data)

    def __len__(self) -> int:
        return len(self._waiting)
