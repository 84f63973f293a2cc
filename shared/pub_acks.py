"""JetStream's replies to the events berth publishes, matched to their publishes in the
client's read loop (`nats_io.Client.publish_stored_batch`).

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


def outcome(headers: bytes | None, data: bytes) -> int | BaseException:
    """What JetStream's reply to a publish says: the stream sequence, or the exception."""
    if headers is not None and headers.startswith(_NO_RESPONDERS):
        return nats.js.errors.NoStreamResponseError()
    try:
        reply = _decode_reply(data)
    except msgspec.DecodeError as exc:
        return UnreadableReply(f"unreadable reply to a publish: {exc}")
    if reply.error is not None:
        return refusal(reply.error)
    if reply.seq < 1:  # a stream's sequences start at 1: not JetStream's answer
        return UnreadableReply(f"a reply to a publish with no sequence: {data!r}")
    return reply.seq


class AckBatch:
    """The replies to publishes sent together, awaited as one (`PendingAcks.expect_in`):
    no future, done callback or wake-up per publish. Half the asyncio bookkeeping of a
    publish awaited on its own was spent on those (docs/performance.md)."""

    __slots__ = ("_tokens", "_waiting", "done", "left", "outcomes", "unsent")

    def __init__(self, size: int, waiting: dict[bytes, Any]) -> None:
        # Each publish's stream sequence, or what it raised or its reply said; None while
        # it waits for its reply.
        self.outcomes: list[int | BaseException | None] = [None] * size
        self.left = size
        # The publishes that `publish` raised for (their outcome is what it raised): never
        # sent, as far as the caller can tell.
        self.unsent: set[int] = set()
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tokens: list[bytes] = []
        self._waiting = waiting
        if not size:
            self.done.set_result(None)

    def not_sent(self, index: int, error: BaseException) -> None:
        """Publish `index` raised `error`: its outcome, and no reply is awaited for it."""
        self._waiting.pop(self._tokens[index], None)
        self.unsent.add(index)
        self.settle(index, error)

    def settle(self, index: int, result: int | BaseException) -> None:
        """Publish `index`'s outcome: what its reply said."""
        if self.outcomes[index] is not None:
            return
        self.outcomes[index] = result
        self.left -= 1
        if not self.left and not self.done.done():
            self.done.set_result(None)

    async def wait(self, timeout: float) -> list[int | BaseException]:
        """Every publish's outcome, in order, once each has one, or after `timeout`
        seconds: each still unanswered then has a TimeoutError, and a late reply is passed
        over."""
        try:
            if self.left:
                async with asyncio.timeout(timeout):
                    await self.done
        except TimeoutError:
            pass
        finally:
            self.give_up(TimeoutError(f"no reply within {timeout:g}s"))
        return [result for result in self.outcomes if result is not None]

    def give_up(self, why: BaseException) -> None:
        """No more replies are awaited: each publish still without one has `why`, and a
        late reply is passed over."""
        for token in self._tokens:
            self._waiting.pop(token, None)
        for index, result in enumerate(self.outcomes):
            if result is None:
                self.outcomes[index] = why
        self.left = 0


class PendingAcks:
    """The publishes awaiting JetStream's reply, by the token that ends their reply subject:
    each one of a batch (`expect_in`; a lone publish is a batch of one). A publish whose
    batch's wait is over is forgotten."""

    def __init__(self) -> None:
        self._waiting: dict[bytes, tuple[AckBatch, int]] = {}
        self._tokens = itertools.count(1)

    def batch(self, size: int) -> AckBatch:
        """A batch of `size` publishes to await together."""
        return AckBatch(size, self._waiting)

    def expect_in(self, batch: AckBatch) -> bytes:
        """A new token, whose reply settles the next publish of `batch` (0, 1, ...)."""
        token = b"%x" % next(self._tokens)
        self._waiting[token] = (batch, len(batch._tokens))
        batch._tokens.append(token)
        return token

    def take(self, token: bytes, headers: bytes | None, data: bytes) -> None:
        """A reply: it settles its publish, if that still waits."""
        waiting = self._waiting.pop(token, None)
        if waiting is not None:
            batch, index = waiting
            batch.settle(index, outcome(headers, data))

    def __len__(self) -> int:
        return len(self._waiting)
