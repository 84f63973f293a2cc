"""NATS JetStream plumbing: connecting, creating streams idempotently, publishing with
dedup ids and trace context, and reading the events stream in order."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import functools
import logging
import random
import ssl
import time
import types
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    ItemsView,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    Header,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError

from berth.shared import credentials, metrics, nats_frames, pub_acks, service, subjects, telemetry
from berth.shared.config import Settings
from berth.shared.credentials import Credentials, Role
from berth.shared.event_origin import RefusedEvent, read_event
from berth.shared.messages import AnyEvent, encode
from berth.shared.nats_parser import FastParser

T = TypeVar("T")

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
        # Submit clients read their outcomes one message at a time, by subject, which is
        # what their permissions can be pinned to (a consumer's filter cannot).
        allow_direct=True,
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
    # The workspace bundles' object store, as `create_object_store` makes a bucket (so any
    # client's object store API binds to it), with an age limit: a bundle not submitted
    # for 30 days is dropped, and a retry that needs it fails with a clear reason.
    StreamConfig(
        name=subjects.BUNDLES_STREAM,
        subjects=[subjects.BUNDLE_CHUNKS, subjects.BUNDLE_META],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=30 * DAY,
        discard=DiscardPolicy.NEW,
        allow_rollup_hdrs=True,
        allow_direct=True,
    ),
]


def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or several separated by commas (the
    nodes of a cluster; nats-py picks one and fails over to the others)."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise SystemExit(f"no NATS server in {url!r}")
    return urls


def tls_context(ca: str, cert: str = "", key: str = "") -> ssl.SSLContext | None:
    """The client side of TLS to NATS: the server is verified against `ca` (its certificate
    must name the host in the URL); `cert`/`key` are this client's certificate, for servers
    that ask for one. None without a CA (plain connections)."""
    if not ca:
        if cert or key:
            raise SystemExit("BERTH_NATS_TLS_CERT/KEY need BERTH_NATS_TLS_CA too")
        return None
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        if cert or key:
            if not (cert and key):
                raise SystemExit("BERTH_NATS_TLS_CERT and BERTH_NATS_TLS_KEY go together")
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"NATS TLS files: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def settings_tls(settings: Settings) -> ssl.SSLContext | None:
    return tls_context(settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key)


def tls_options(tls: ssl.SSLContext | None) -> dict[str, Any]:
    """nats-py's arguments for TLS. The handshake comes first, before the server says
    anything: a client that read the plain-text INFO first would go on without TLS if an
    attacker's INFO said so (berth's server configs accept both: `handshake_first` with a
    wait, servers.HANDSHAKE_FIRST_WAIT)."""
    if tls is None:
        return {}
    return {"tls": tls, "tls_handshake_first": True}


def auth_options(creds: Credentials | None) -> dict[str, Any]:
    """nats-py's connect arguments for an identity: its nkey signature, and replies under its
    own inbox prefix (the only inbox its permissions let it read)."""
    if creds is None:
        return {}
    return {"nkeys_seed_str": creds.seed, "inbox_prefix": subjects.inbox_prefix(creds.name)}


# A stream consumer's data message as `Client.take_stream` hands it over: stream sequence,
# subject, payload, raw headers. False: no room, nats-py is to queue it.
StreamTaker = Callable[[int, bytes, bytes, bytes | None], bool]


def ack_reply_tokens(reply: bytes) -> list[bytes] | None:
    """The tokens of a JetStream message's reply subject as read off the wire,
    "$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<stored ns>.
    <pending>"; None for any other form (a longer one names a domain and account: nats-py
    reads those)."""
    tokens = reply.split(b".")
    if len(tokens) == 9 and tokens[0] == b"$JS" and tokens[1] == b"ACK":
        return tokens
    return None


class PullTaker(Protocol):
    """What `Client.take_pull` hands a pull subscription's messages to."""

    def take(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> bool:
        """A data message as read; False: nats-py is to queue it."""

    def queued(self) -> None:
        """nats-py queued a message of the subscription (a status, or one not taken)."""


# A header block with no status line: what every data message of a stream carries.
_PLAIN_HEADERS = b"NATS/1.0\r\n"


def _takes_streams() -> bool:
    """Whether this nats-py keeps an ordered consumer's state where `Client.take_stream`
    reads and writes it (nats-py 2.x does); if not, followers use nats-py's callbacks."""
    jsi = getattr(JetStreamContext, "_JSI", None)
    if jsi is None:
        return False
    names = set(jsi.__init__.__code__.co_names) | set(jsi.track_sequences.__code__.co_names)
    return {"_dseq", "_sseq", "_active", "_fciseq", "_cmeta", "_sub"} <= names


TAKES_STREAMS = _takes_streams()


class WireHeaders(Mapping[str, str]):
    """A message's headers as they came, parsed the first time they are read: a fold reads
    few events' headers (the scheduler, a submit's trace context), and parsing every one
    was ~5 % of a busy scheduler's CPU. Parsed as `Client` parses them."""

    __slots__ = ("_parsed", "_raw")

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._parsed: dict[str, str] | None = None

    def _headers(self) -> dict[str, str]:
        if self._parsed is None:
            self._parsed = Client._parse_header_lines(self._raw[len(_PLAIN_HEADERS):])
        return self._parsed

    def __getitem__(self, key: str) -> str:
        return self._headers()[key]

    def __contains__(self, key: object) -> bool:
        # A name whose bytes are nowhere in the block is not in it: most events carry no
        # trace context, and the scheduler asks every submit whether it does.
        if self._parsed is None and isinstance(key, str) and key.isascii() \
                and key.encode() not in self._raw:
            return False
        return key in self._headers()

    # Mapping's own `items` and `get` go through `__getitem__` key by key.
    def items(self) -> ItemsView[str, str]:
        return self._headers().items()

    def get(self, key: str, default: Any = None) -> Any:
        return self._headers().get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._headers())

    def __len__(self) -> int:
        return len(self._headers())

    def __repr__(self) -> str:
        return f"WireHeaders({self._headers()!r})"


class Client(NATS):
    """nats-py's client with a cheaper header parser. Every events-stream message carries
    headers (its dedup id, its trace context), and nats-py tests each header name for
    whitespace one character at a time through a generator: about 8% of a busy
    scheduler's CPU under cProfile (docs/performance.md). Same result, one `split`.
    Its protocol parser is `nats_parser.FastParser`, for the same reason.

    It also takes subscriptions whose messages are handed to a plain function as they are
    read (`subscribe_now`), for the many small messages of a large cluster (heartbeats),
    and an ordered stream consumer's messages straight from the read loop (`take_stream`),
    for every follower of the events stream; and JetStream's replies to its publishes there
    too (`publish_stored_batch`)."""

    def __init__(self) -> None:
        super().__init__()
        self._ps = FastParser(self)
        self._handlers: dict[int, Callable[[Msg], None]] = {}
        self._streams: dict[Subscription, StreamTaker] = {}
        self._pulls: dict[Subscription, PullTaker] = {}
        self._acks = pub_acks.PendingAcks()
        self._ack_sid = -1  # the subscription JetStream's replies come on, once made
        self._ack_prefix = b""
        # Many tasks may publish first at once: one makes the subscription, the others wait
        # for it (two would leave the first one's replies unread, and its publishes to time out).
        self._ack_subscribing = asyncio.Lock()

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """nats-py's `publish`, step for step (its checks, errors, counters and flushing),
        with the frame built by `nats_frames`: a quarter of nats-py's cost per message."""
        if not self._skip_subject_validation and not (
                nats_frames.check_subject(subject)
                and (not reply or nats_frames.check_subject(reply))):
            raise nats.errors.BadSubjectError
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        size = len(payload)
        if not self.is_connected and (self._max_pending_size <= 0 or size
                                      + self._pending_data_size > self._max_pending_size):
            # Reconnecting with no buffer, or a full one.
            raise nats.errors.OutboundBufferLimitError
        if size > self._max_payload:
            raise nats.errors.MaxPayloadError
        if not subject:
            raise nats.errors.BadSubjectError
        frame = nats_frames.publish_frame(subject, reply, payload, headers)
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += size
        self._pending.append(frame)
        self._pending_data_size += len(frame)
        if self._max_pending_size > 0 and self._pending_data_size > self._max_pending_size:
            await self._flush_pending(force_flush=True)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    async def _subscribe_acks(self) -> None:
        """The subscription JetStream's replies to this client's publishes come on, made
        once. Under this client's own inbox prefix: the only replies its permissions let
        it read."""
        if self._ack_sid < 0:
            async with self._ack_subscribing:
                if self._ack_sid < 0:
                    prefix = bytes(self._inbox_prefix) + b"." + bytes(self._nuid.next()) + b"."
                    sub = await self.subscribe(prefix.decode() + "*")  # no callback: no task
                    self._ack_prefix, self._ack_sid = prefix, sub._id

    async def publish_stored_batch(self, messages: Sequence[tuple[str, bytes, dict[str, str]]],
                                   stream: str) -> pub_acks.AckBatch:
        """Publishes messages (subject, payload, headers) to `stream`, as
        `JetStreamContext.publish_async` with `stream` does (the header that makes JetStream
        refuse one whose subject is another stream's, added to `headers` in place as
        nats-py adds it, so a retry of the same dict sends it again). Their replies are
        awaited together (`AckBatch.wait`), matched in the read loop: in its outcomes, each
        publish's stream sequence, or the exception nats-py's `JetStreamContext.publish`
        raises for its reply (shared/pub_acks.py), or what `publish` raised for it
        (`AckBatch.unsent` says which)."""
        await self._subscribe_acks()
        batch = self._acks.batch(len(messages))
        reply_prefix = self._ack_prefix.decode()
        try:
            for index, (subject, payload, headers) in enumerate(messages):
                token = self._acks.expect_in(batch)
                headers[Header.EXPECTED_STREAM] = stream
                try:
                    await self.publish(subject, payload, reply=reply_prefix + token.decode(),
                                       headers=headers)
                except Exception as exc:  # e.g. the connection closed: the caller judges
                    batch.not_sent(index, exc)
        except BaseException as exc:  # cancelled: no one will wait for these replies
            batch.give_up(exc)
            raise
        return batch

    async def subscribe_now(self, subject: str, handler: Callable[[Msg], None]
                            ) -> Subscription:
        """nats-py hands each message of a subscription to its callback through a queue
        and the subscription's task: a wake-up of that task per message, most of the cost of
        a small message arriving alone (heartbeats: one a second, or one in five, per host). Here
        `handler` runs in the reading task, message by message, and must not block: work
        that waits goes to a task of its own. A handler's error is logged, not raised."""
        sub = await self.subscribe(subject)  # no callback: nats-py starts no task for it
        self._handlers[sub._id] = handler
        return sub

    def take_stream(self, psub: JetStreamContext.PushSubscription, take: StreamTaker) -> None:
        """Hands the data messages of `psub` (an ordered consumer's subscription made
        without a callback) to `take` as they are read: its stream sequence, subject,
        payload and raw headers. nats-py would build a `Msg`, parse its headers and queue
        it for the subscription's task: more than half of the 21-25 us a follower spent
        per message (bench/follow.py --raw). The ordered consumer's bookkeeping is done here as
        nats-py does it, so its gap detection, idle heartbeats and flow control work
        unchanged. nats-py handles, as before: control messages; a gap (it starts the
        consumer again after the last message taken); and any message while the
        subscription's queue holds some (`take` refused one for want of room, or they
        came before this call), so that the queue's messages stay ahead of later ones.
        Requires `TAKES_STREAMS`."""
        self._streams[psub._sub] = take

    def release_stream(self, psub: JetStreamContext.PushSubscription) -> None:
        self._streams.pop(psub._sub, None)

    def take_pull(self, sub: Subscription, taker: PullTaker) -> None:
        """Hands the data messages of a pull subscription's inbox `sub` to `taker` as they
        are read, while nats-py's queue for it is empty (so they never overtake one queued);
        status messages, and a message `taker` refuses, are queued as nats-py does, and
        `taker.queued()` is told. Requires `TAKES_STREAMS`. Undone when `sub` is
        unsubscribed."""
        self._pulls[sub] = taker

    def release_pull(self, sub: Subscription) -> None:
        self._pulls.pop(sub, None)

    def _take_now(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                  headers: bytes | None) -> bool:
        """Hands a message to its `subscribe_now` handler or `take_stream` taker in the read
        loop, without a coroutine (called by `FastParser`). False: `_process_msg` is to
        handle it, as nats-py does."""
        if sid == self._ack_sid:  # a reply to `publish_stored_batch`, a status line too
            sub = self._subs.get(sid)
            if sub is not None:
                self._count_in(sub, data)
            self._acks.take(subject[len(self._ack_prefix):], headers, data)
            return True
        if headers is not None and not headers.startswith(_PLAIN_HEADERS):
            return False  # a status line: a control message, nats-py's
        sub = self._subs.get(sid)
        if sub is None:
            return False
        handler = self._handlers.get(sid)
        if handler is not None:
            self._count_in(sub, data)
            # As nats-py: a block of no headers is None.
            hdr = self._parse_header_lines(headers[len(_PLAIN_HEADERS):]) or None \
                if headers is not None else None
            self._call_handler(handler, sid, subject, reply, data, hdr)
            return True
        take = self._streams.get(sub)
        if take is None:
            pull = self._pulls.get(sub)
            if pull is None or not sub._pending_queue.empty() \
                    or not pull.take(subject, reply, data, headers):
                return False
            self._count_in(sub, data)
            return True
        tokens = ack_reply_tokens(reply)
        if tokens is None:
            return False  # a flow-control request, or a reply form nats-py reads itself
        jsi = sub._jsi
        dseq = int(tokens[6])
        if jsi is None or dseq != jsi._dseq or not sub._pending_queue.empty():
            return False
        seq = int(tokens[5])
        if not take(seq, subject, data, headers):
            return False
        self._count_in(sub, data)
        # nats-py's own steps for an ordered consumer's data message.
        jsi._active = True
        jsi._dseq = dseq + 1
        jsi._sseq = seq
        jsi._fciseq += 1
        jsi._cmeta = reply.decode()
        return True

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                           headers: bytes | None) -> None:
        if not self._take_now(sid, subject, reply, data, headers):
            await self._process_untaken(sid, subject, reply, data, headers)

    async def _process_untaken(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                               headers: bytes | None) -> None:
        """A message `_take_now` did not take (`FastParser` calls this after asking it)."""
        handler = self._handlers.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            if self._pulls:
                sub = self._subs.get(sid)
                pull = self._pulls.get(sub) if sub is not None else None
                if pull is not None:
                    pull.queued()
            return
        sub = self._subs.get(sid)
        if sub is None:
            return
        self._count_in(sub, data)
        hdr = await self._process_headers(headers) if headers else None
        self._call_handler(handler, sid, subject, reply, data, hdr)

    def _count_in(self, sub: Subscription, data: bytes) -> None:
        """nats-py's counting of a message delivered, for one handled here."""
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        sub._received += 1

    def _call_handler(self, handler: Callable[[Msg], None], sid: int, subject: bytes,
                      reply: bytes, data: bytes, hdr: dict[str, str] | None) -> None:
        try:
            handler(self._build_message(sid, subject, reply, data, hdr))
        except Exception:
            log.exception("the handler of a message on %s failed", subject.decode(errors="replace"))

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        # Unsubscribed: the handler goes too (a leader's holds its whole term's state).
        self._handlers.pop(sid, None)
        sub = self._subs.get(sid)
        if sub is not None:
            # Not `_streams`: nats-py moves an ordered consumer's subscription object to a
            # new sid this way, and its taker goes on.
            self._pulls.pop(sub, None)
        super()._remove_sub(sid, max_msgs)

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue  # a malformed name, skipped as nats-py does
            # A name with whitespace in it is not a token: skipped, as nats-py does.
            if key and key.split() != [key]:
                continue
            out[key] = value.strip().decode("utf-8", "replace")
        return out


async def subscribe_now(nc: NATS, subject: str, handler: Callable[[Msg], None]) -> Subscription:
    """`Client.subscribe_now` on berth's client; on another, a callback that calls `handler`."""
    if isinstance(nc, Client):
        return await nc.subscribe_now(subject, handler)

    async def callback(msg: Msg) -> None:
        handler(msg)

    return await nc.subscribe(subject, cb=callback)


async def connect(url: str, name: str, creds: Credentials | None = None,
                  refused_for: float = 10.0, tls: ssl.SSLContext | None = None) -> NATS:
    """A connection that outlives NATS outages: the first connect is retried (with backoff
    and jitter) until the server answers, and reconnects never give up. A server that
    refuses our identity is retried for `refused_for` seconds only (a just-added identity
    is known once the server has reloaded its config), then it ends the service. `url` may
    name several servers (`server_urls`); `tls` is `tls_context`'s."""
    last_error: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        last_error[:] = [exc]
        log.warning("nats: %s", exc)

    who = creds.name if creds else "no identity"
    refused_since: float | None = None
    pause = 0.1
    while True:
        last_error.clear()
        try:
            client = Client()
            # nats-py types reconnect_time_wait as int; it takes seconds as a float.
            options: dict[str, Any] = {"reconnect_time_wait": 0.5}
            await client.connect(
                server_urls(url),
                name=name,
                max_reconnect_attempts=-1,
                error_cb=on_error,
                **options,
                **auth_options(creds),
                **tls_options(tls),
            )
            return client
        except nats.errors.NoServersError:
            # nats-py says "no servers" for a refused identity too; the error callback
            # heard the server's actual answer.
            why = str(last_error[0]) if last_error else "no answer"
            if "authorization" in why.lower():
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since > refused_for:
                    raise SystemExit(
                        f"berth {name}: NATS at {url} refuses {who}: {why}") from None
            log.warning("cannot connect to NATS at %s as %s (%s); retrying", url, who, why)
        await asyncio.sleep(pause * random.uniform(0.5, 1.5))
        pause = min(pause * 2, 2.0)


async def connect_service(settings: Settings, name: str, role: Role, scope: str = "") -> NATS:
    """A service's connection, as its own identity; credentials it cannot use end the
    service with one line saying why."""
    try:
        creds = credentials.for_service(settings.nats_creds, settings.data_dir, role, scope)
    except credentials.CredentialsError as exc:
        raise SystemExit(f"berth {name}: {exc}") from None
    return await connect(settings.nats_url, name, creds, tls=settings_tls(settings))


# JetStream's answers while a cluster is still forming or has just lost a node: no meta
# leader yet (10008 temporarily unavailable, 10009 not leader), too few peers up for the
# replicas asked (10005 no suitable peers, 10023 insufficient resources). Worth a retry.
CLUSTER_NOT_READY = {10005, 10008, 10009, 10023}


def _cluster_not_ready(exc: BaseException) -> bool:
    if isinstance(exc, nats.js.errors.APIError):
        return exc.err_code in CLUSTER_NOT_READY or exc.code == 503
    return isinstance(exc, nats.errors.TimeoutError | TimeoutError
                      | nats.errors.NoRespondersError | nats.js.errors.ServiceUnavailableError)


async def _create_or_update(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config=config)
    except BadRequestError as exc:
        if _cluster_not_ready(exc):
            raise
        # It exists with another config. A service started with fewer replicas than the
        # stream has (BERTH_STREAM_REPLICAS left at 1 on a cluster) never takes copies away.
        current = (await js.stream_info(str(config.name))).config.num_replicas or 1
        if current > (config.num_replicas or 1):
            log.warning("stream %s keeps its %d replicas (asked for %s)", config.name,
                        current, config.num_replicas)
            config = dataclasses.replace(config, num_replicas=current)
        await js.update_stream(config=config)


async def while_cluster_forms(what: str, attempt: Callable[[], Awaitable[T]],
                              timeout: float = 60.0) -> T:
    """`attempt()`, retried with backoff while JetStream answers that the cluster is not
    ready (no meta or stream leader yet, too few peers, or no answer in time: an election
    after a node was lost), for up to `timeout` seconds; any other error is raised at once.
    A service starting during an election waits it out instead of exiting."""
    deadline = time.monotonic() + timeout
    pause = 0.1
    while True:
        try:
            return await attempt()
        except Exception as exc:
            if not _cluster_not_ready(exc) or time.monotonic() + pause > deadline:
                raise
            log.info("%s not done yet: %s; retrying", what, exc or type(exc).__name__)
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(pause * 2, 2.0)


async def ensure_streams(js: JetStreamContext, replicas: int = 1, timeout: float = 60.0
                         ) -> None:
    """Creates every stream with `replicas` copies (BERTH_STREAM_REPLICAS; 3 on a 3-node
    cluster), or updates it to this config; safe to call from every service. A cluster
    that has not elected its JetStream meta leader yet, or has too few nodes up for the
    replicas, is waited for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    for base in STREAMS:
        config = dataclasses.replace(base, num_replicas=replicas)
        await while_cluster_forms(
            f"stream {config.name} ({replicas} replicas)",
            functools.partial(_create_or_update, js, config),
            max(0.0, deadline - time.monotonic()))


def message_headers(msg_id: str, passed_on: Mapping[str, str] | None = None) -> dict[str, str]:
    """A message's dedup id and trace context: the current span's, or with `passed_on`
    (the headers of the message it answers, when no span was started for that:
    telemetry.NO_SPAN), the trace context those carried, unchanged."""
    headers = {"Nats-Msg-Id": msg_id}
    if passed_on is None:
        return telemetry.inject(headers)
    headers.update(telemetry.trace_fields(passed_on))
    return headers


@dataclass(frozen=True)
class Outgoing:
    """One event to publish: its subject, encoded body and headers (`message_headers`)."""

    subject: str
    payload: bytes
    headers: dict[str, str]


# A retry is the same message with the same dedup id, so retrying is always safe; these
# are the failures worth retrying. Anything else (a message over max_payload, a wrong
# stream) cannot succeed by retrying: that message is logged and dropped, never raised, so
# no publish stops a service (every message is bounded by construction, shared/bounded.py,
# so this is a last resort). JetStream's 503 "temporarily unavailable" comes while a NATS
# cluster re-elects its meta leader (after a node rejoins from a partition): it passes.
RETRIABLE = (nats.errors.TimeoutError, TimeoutError, nats.errors.ConnectionClosedError,
             nats.errors.ConnectionReconnectingError, nats.js.errors.NoStreamResponseError,
             nats.js.errors.ServiceUnavailableError)
# A publish JetStream answered with an error is sent again too. Some pass: 503 while a
# stream elects its leader, 409 (10158) for a retry while the first copy is still being
# stored. The rest were retried before as well: nats-py's `publish_async` never settles a
# publish refused that way, so it waited out its timeout and was sent again.
REPLY_RETRIABLE = (*RETRIABLE, nats.js.errors.APIError, pub_acks.UnreadableReply)


async def publish_to_stream(nc: NATS, messages: Sequence[tuple[str, bytes, dict[str, str]]],
                            stream: str, timeout: float = 5.0) -> list[int]:
    """Publishes messages (subject, payload, headers) to `stream`, all in flight at once
    and their replies awaited together; their stream sequences, in order. Raises what
    `JetStreamContext.publish` would (TimeoutError once `timeout` passes unanswered) for
    the first that failed (the others may be stored). A lone publish is a list of one. Through
    berth's client where `nc` is one (`Client.publish_stored_batch`: bench/scale.py's
    client, which submits and reads the log, spent 151-212 µs of CPU per job through
    nats-py's path, 122-160 through a future per publish, docs/performance.md)."""
    if not isinstance(nc, Client):
        js = nc.jetstream()
        acks = await asyncio.gather(*(js.publish(subject, payload, timeout=timeout,
                                                 stream=stream, headers=headers)
                                      for subject, payload, headers in messages))
        return [int(ack.seq) for ack in acks]
    batch = await nc.publish_stored_batch(messages, stream)
    seqs: list[int] = []
    for result in await batch.wait(timeout):
        if isinstance(result, TimeoutError):
            raise nats.errors.TimeoutError from None  # as `JetStreamContext.publish` raises it
        if isinstance(result, BaseException):
            raise result
        seqs.append(result)
    return seqs


async def publish_event(
    js: JetStreamContext, subject: str, event: msgspec.Struct, msg_id: str, attempts: int = 0,
    timeout: float = 5.0,
) -> int:
    """Publishes one event with a dedup id; retries while NATS is unreachable so a
    state change is never dropped (attempts=0: retry forever). Returns the stream sequence."""
    [seq] = await publish_events(
        js, [Outgoing(subject, encode(event), message_headers(msg_id))], attempts=attempts,
        timeout=timeout)
    return seq


async def publish_events(js: JetStreamContext, outgoing: Sequence[Outgoing],
                         attempts: int = 0, timeout: float = 5.0) -> list[int]:
    """Publishes events with all their acks awaited together: one wait per batch instead
    of a round trip, timer and task per event. Retries what failed as `publish_event` does.
    Returns the stream sequences, in order; 0 for a message dropped because it could never
    be stored (logged)."""
    seqs = [0] * len(outgoing)
    todo = list(range(len(outgoing)))
    tries = 0
    nc = js._nc
    while todo:
        tries += 1
        if isinstance(nc, Client):
            failed = await _publish_batch(nc, outgoing, todo, seqs, timeout)
        else:
            failed = await _publish_each(js, outgoing, todo, seqs, timeout)
        if not failed:
            return seqs
        if attempts and tries >= attempts:
            raise failed[0][1]
        first, why = failed[0]
        metrics.PUBLISH_RETRIES.inc(len(failed))
        log.warning("publish of %d events (to %s, ...) failed (%s), retrying",
                    len(failed), outgoing[first].subject, why)
        todo = sorted(i for i, _ in failed)
        await asyncio.sleep(min(0.1 * tries, 2.0))
    return seqs


async def _publish_batch(nc: Client, outgoing: Sequence[Outgoing], todo: list[int],
                         seqs: list[int], timeout: float) -> list[tuple[int, BaseException]]:
    """One try of `publish_events` through berth's client: the sequences stored go into
    `seqs`; returns the publishes to retry, with why."""
    batch = await nc.publish_stored_batch(
        [(outgoing[i].subject, outgoing[i].payload, outgoing[i].headers) for i in todo],
        subjects.EVENTS_STREAM)
    failed: list[tuple[int, BaseException]] = []
    for k, (i, result) in enumerate(zip(todo, await batch.wait(timeout), strict=True)):
        if isinstance(result, int):
            seqs[i] = result
        elif isinstance(result, RETRIABLE if k in batch.unsent else REPLY_RETRIABLE):
            failed.append((i, result))
        else:  # e.g. MaxPayloadError: retrying cannot help
            _dropped(outgoing[i], result)
    return failed


async def _publish_each(js: JetStreamContext, outgoing: Sequence[Outgoing], todo: list[int],
                        seqs: list[int], timeout: float) -> list[tuple[int, BaseException]]:
    """`_publish_batch` through nats-py's own client: `publish_async`, a future each."""
    acks: dict[int, asyncio.Future[PubAck]] = {}
    failed: list[tuple[int, BaseException]] = []
    for i in todo:
        out = outgoing[i]
        try:
            acks[i] = await js.publish_async(out.subject, out.payload, headers=out.headers,
                                             stream=subjects.EVENTS_STREAM)
        except RETRIABLE as error:
            failed.append((i, error))
        except Exception as error:  # e.g. MaxPayloadError: retrying cannot help
            _dropped(out, error)
    if acks:
        await asyncio.wait(acks.values(), timeout=timeout)
    for i, ack in acks.items():
        if not ack.done():
            ack.cancel()
            failed.append((i, TimeoutError(f"no ack within {timeout:g}s")))
        elif (refused := ack.exception()) is not None:
            if isinstance(refused, REPLY_RETRIABLE):
                failed.append((i, refused))
            else:
                _dropped(outgoing[i], refused)
        else:
            seqs[i] = int(ack.result().seq)
    return failed


def _dropped(out: Outgoing, error: BaseException) -> None:
    log.error("dropped a message to %s (%d bytes) that cannot be stored: %s: %s",
              out.subject, len(out.payload), type(error).__name__, error)


class EventPublisher:
    """Publishes events from many tasks (the reports of many attempts, the outcomes of many
    submits) in batches: what arrives while a batch awaits its acks goes out together in
    the next one. One batch in flight keeps the client's pending acks bounded (nats-py's
    publish_async semaphore costs time per waiter)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self.queue: list[tuple[Outgoing, asyncio.Future[int]]] = []
        self.flusher: asyncio.Task[None] | None = None

    async def publish(self, subject: str, event: msgspec.Struct, msg_id: str,
                      passed_on: Mapping[str, str] | None = None) -> int:
        """Like `publish_event`: retried until stored; returns the stream sequence.
        `passed_on`: as `message_headers`'."""
        return await self.submit(subject, event, msg_id, passed_on)

    def submit(self, subject: str, event: msgspec.Struct, msg_id: str,
               passed_on: Mapping[str, str] | None = None,
               done: asyncio.Future[int] | None = None) -> asyncio.Future[int]:
        """`publish` without a coroutine: the future of the stream sequence (`done`, if
        given), for a caller that would otherwise start a task per event to await it."""
        if done is None:
            done = asyncio.get_running_loop().create_future()
        self.queue.append((Outgoing(subject, encode(event), message_headers(msg_id, passed_on)),
                           done))
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.create_task(self._flush())
        return done

    async def _flush(self) -> None:
        while self.queue:
            batch, self.queue = self.queue, []
            try:
                seqs = await publish_events(self.js, [out for out, _ in batch])
            except Exception as exc:  # not retriable: each publisher hears of it
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for (_, done), seq in zip(batch, seqs, strict=True):
                if not done.done():
                    done.set_result(seq)


@dataclass(slots=True)
class EventRecord:
    """An events-stream message as the fold takes it: the event, or None (with `refused`
    saying why) for a message the fold does not believe (shared/event_origin.py)."""

    seq: int
    event: AnyEvent | None
    headers: Mapping[str, str]
    refused: str = ""


@dataclass(slots=True)
class RawEvent:
    """An events-stream message as stored: its sequence, subject, JSON bytes and headers."""

    seq: int
    data: bytes
    headers: Mapping[str, str]
    subject: str = ""

    def record(self) -> EventRecord:
        try:
            return EventRecord(self.seq, read_event(self.subject, self.data), self.headers)
        except RefusedEvent as exc:
            self._log_refused(exc)
            return EventRecord(self.seq, None, self.headers, refused=str(exc))

    def event(self) -> AnyEvent | None:
        """`record().event`, without the record: for a fold that needs only the event."""
        try:
            return read_event(self.subject, self.data)
        except RefusedEvent as exc:
            self._log_refused(exc)
            return None

    def _log_refused(self, exc: RefusedEvent) -> None:
        log.error("event %d on %s refused, skipped: %s", self.seq, self.subject, exc)


def _ack_tokens(msg: Msg) -> list[str] | None:
    """The tokens of a JetStream message's reply subject in its 9-token form; None for any
    other (nats-py's `msg.metadata` reads those)."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
        return tokens
    return None


def stream_seq(msg: Msg) -> int:
    """A JetStream message's stream sequence, read from its reply subject: nats-py's
    `msg.metadata` builds two dataclasses and a datetime per message, a tenth of a
    catching-up dashboard's CPU. Replies are "$JS.ACK.<stream>.<consumer>.<delivered>.
    <stream seq>...." (9 tokens) or, from servers that name a domain and account,
    "$JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<stream seq>...."."""
    tokens = _ack_tokens(msg)
    if tokens is not None:
        return int(tokens[5])
    return msg.metadata.sequence.stream  # nats-py's reading, and its error for a non-JS one


NO_HEADERS: Mapping[str, str] = types.MappingProxyType({})


def stored_ns(msg: Msg) -> int:
    """When the stream stored a JetStream message, in ns since the epoch, to the microsecond
    as nats-py's `msg.metadata.timestamp` gives it (job ids are derived from it, so it must
    not change), read from the reply subject as `stream_seq` reads the sequence; 0 if the
    server gave none."""
    tokens = _ack_tokens(msg)
    if tokens is not None:
        stamp: datetime.datetime | None = datetime.datetime.fromtimestamp(
            int(tokens[7]) / 1_000_000_000.0, datetime.UTC)
    else:
        stamp = msg.metadata.timestamp
    return int(stamp.timestamp() * 1e9) if stamp else 0


def wire_event(seq: int, subject: bytes, data: bytes, headers: bytes | None) -> RawEvent:
    """A message as a taker gets it off the wire (`Client.take_stream`, `take_pull`), as
    stored: its headers read only when asked for."""
    return RawEvent(seq, data, WireHeaders(headers) if headers else NO_HEADERS,
                    subject.decode())


def raw_event(msg: Msg, seq: int | None = None) -> RawEvent:
    """`msg` as stored; `seq`: its stream sequence, if the caller has read it already."""
    # The message's own headers, not a copy: the message is dropped once read, and no
    # reader of a record's headers writes to them (a copy per event was 3% of a
    # catching-up dashboard's samples).
    return RawEvent(stream_seq(msg) if seq is None else seq, msg.data,
                    msg.headers or {}, msg.subject)


# What a follower holds for its reader before the client queues the next message (in its
# own queue, up to its pending limits; past them it drops them, and the ordered consumer
# starts again after the last one taken). The server does not wait for a follower that
# falls behind (flow control unanswered, it still sent all of 200,000 events), so the
# backlog is held here or in the client's queue either way, and here it costs less:
# 200,000 events held 111 MiB here against 181 MiB as nats-py's queued messages, and were
# then read at a sixth of the CPU. The payload bytes held here and in that queue are
# bounded together as the queue alone was before (nats-py's default for a JetStream
# subscription, 256 MiB), half each.
# (A buffer of 10,000, with the rest queued, was kept for a while on the strength of one
# W4 run at 10,000 hosts; later pairs read the same peak RSS either way, docs/performance.md.)
FOLLOW_BUFFER = 1_000_000
FOLLOW_BUFFER_BYTES = 128 * 1024 * 1024
FOLLOW_QUEUE_BYTES = 128 * 1024 * 1024
FOLLOW_QUEUE_MSGS = 1_000_000
FOLLOW_YIELD_EVERY = 64


# A follower that has heard nothing for this long asks the server whether its consumer still
# exists and has messages for it; if it is gone, or has some yet delivers none, the follower
# subscribes again after the last message it got.
FOLLOW_STALL_CHECK = 5.0


async def follow_raw_events(
    js: JetStreamContext, start_seq: int = 1, filter_subject: str = subjects.EVENTS_ALL,
    stall_check: float = FOLLOW_STALL_CHECK, drained: asyncio.Event | None = None,
) -> AsyncGenerator[RawEvent]:
    """Yields every events-stream message from `start_seq` on, in stream order, forever (an
    ordered consumer: the client detects gaps and re-creates it, so nothing is skipped).

    Read into a buffer as the client reads them (`Client.take_stream`; with another client,
    through a subscription callback), drained by the reader as it comes: nats-py's message
    iterator starts a task and an `asyncio.wait` per message, about a fifth of a busy
    follower's CPU, and its queue and callback task most of the rest (docs/performance.md).

    Watched, not only trusted to the client: after a leader stalled for 6 s at 10,000
    hosts, its consumer was gone and nats-py never made another, so its fold stopped for
    good while it kept the lease and placed nothing (docs/reliability.md). Silent for
    `stall_check` seconds, the follower asks for its consumer's state, and subscribes again
    after the last sequence it got if the consumer is gone or holds messages it does not
    deliver. A message at or below that sequence (from the subscription it left) is
    dropped, so none is yielded twice.

    `drained`, if given, is set while the reader has been given every message this client
    holds (it asked for the next and there is none yet), and cleared as one arrives."""
    buffer: collections.deque[RawEvent] = collections.deque()
    arrived = asyncio.Event()
    room = asyncio.Event()
    last_seq = start_seq - 1
    held = 0  # payload bytes in `buffer`
    client = js._nc if TAKES_STREAMS and isinstance(js._nc, Client) else None
    taken = client is not None

    def full() -> bool:
        return len(buffer) >= FOLLOW_BUFFER or held >= FOLLOW_BUFFER_BYTES

    def accept(raw: RawEvent) -> None:
        nonlocal last_seq, held
        if raw.seq <= last_seq:
            return  # delivered again after a re-subscription
        last_seq = raw.seq
        held += len(raw.data)
        buffer.append(raw)
        arrived.set()
        if drained is not None:
            drained.clear()

    def take(seq: int, subject: bytes, data: bytes, headers: bytes | None) -> bool:
        if full():
            return False  # nats-py queues it, and those after it, until the reader is here
        accept(wire_event(seq, subject, data, headers))
        return True

    def take_queued(sub: JetStreamContext.PushSubscription) -> None:
        """What nats-py queued (before `take_stream`, or while the buffer was full)."""
        queue = sub._pending_queue
        while not queue.empty():
            msg = queue.get_nowait()
            queue.task_done()
            sub._sub._pending_size -= len(msg.data)
            accept(raw_event(msg))

    async def on_message(msg: Msg) -> None:
        # With a nats-py whose ordered consumer `take_stream` cannot read.
        while full():
            room.clear()
            await room.wait()
        accept(raw_event(msg))

    async def subscribe(first: int) -> JetStreamContext.PushSubscription:
        sub = await js.subscribe(
            filter_subject,
            stream=subjects.EVENTS_STREAM,
            cb=None if taken else on_message,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            config=ConsumerConfig(opt_start_seq=first, ack_policy=AckPolicy.NONE),
            # The client re-creates an ordered consumer only once it has missed its idle
            # heartbeats; a restarted nats-server forgets the consumer, so until then the
            # follower folds nothing. At 5 s a leader lagged 10-14 s after a restart (its
            # exited attempts kept their reservations: the fault suite's nats-restart); 1 s
            # costs one small message a second per idle follower.
            idle_heartbeat=1.0,
            pending_msgs_limit=FOLLOW_QUEUE_MSGS,
            pending_bytes_limit=FOLLOW_QUEUE_BYTES,
        )
        if client is not None:
            client.take_stream(sub, take)
            take_queued(sub)
        return sub

    async def unsubscribe(sub: JetStreamContext.PushSubscription) -> None:
        if client is not None:
            client.release_stream(sub)
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()

    sub = await subscribe(start_seq)
    try:
        while True:
            while not buffer:
                if taken:
                    take_queued(sub)
                    if buffer:
                        break
                arrived.clear()
                if drained is not None:
                    drained.set()
                if await service.wait_event(arrived, stall_check):
                    continue
                stall = await _stall(sub)
                if stall:
                    log.warning("event follower: %s after sequence %d; subscribing again",
                                stall, last_seq)
                    await unsubscribe(sub)
                    try:
                        sub = await subscribe(last_seq + 1)
                    except (nats.errors.Error, TimeoutError) as exc:
                        # The next check finds the old one gone (or still stalled), and
                        # tries again: a passing fault must not end the follower.
                        log.warning("event follower: subscribing again failed (%s)", exc)
            # A reader that never awaits while the buffer holds messages would hold the
            # event loop for as long: ticks, heartbeats and lease renewals wait their turn
            # every FOLLOW_YIELD_EVERY messages at most (nats-py's iterator suspended on
            # every one).
            for _ in range(min(len(buffer), FOLLOW_YIELD_EVERY)):
                raw = buffer.popleft()
                held -= len(raw.data)
                yield raw
            room.set()
            await asyncio.sleep(0)
    finally:
        # The connection may be closing under a cancelled reader: nothing left to undo.
        await unsubscribe(sub)


async def _stall(sub: JetStreamContext.PushSubscription) -> str:
    """What is wrong with a follower's consumer, the caller having heard nothing for a
    while: it is gone, or it has messages for the follower yet delivers none; "" if
    nothing is, or if NATS does not answer (the client's reconnect is under way)."""
    try:
        info = await sub.consumer_info()
    except nats.js.errors.NotFoundError:
        return "its consumer is gone"
    except (nats.errors.Error, TimeoutError):
        return ""
    if info.num_pending:
        return f"its consumer {info.name} holds {info.num_pending} messages it does not deliver"
    return ""


async def follow_events(
    js: JetStreamContext,
    start_seq: int = 1,
    filter_subject: str = subjects.EVENTS_ALL,
    drained: asyncio.Event | None = None,
) -> AsyncGenerator[EventRecord]:
    """Every message from `start_seq` on, in stream order, forever: decoded and checked
    (`RawEvent.record`). A refused one is yielded too, with no event, so a fold that waits
    for a sequence is never left waiting for one it will not believe. `drained`: as
    `follow_raw_events` says."""
    async for raw in follow_raw_events(js, start_seq, filter_subject, drained=drained):
        yield raw.record()


async def last_event_seq(js: JetStreamContext) -> int:
    info = await js.stream_info(subjects.EVENTS_STREAM)
    return int(info.state.last_seq)


async def events_stream_identity(js: JetStreamContext) -> tuple[str, int]:
    """Which events stream this is ("<name>@<creation time>"), and its last sequence. A
    stream deleted and made again (e.g. its store removed) has another identity, so state
    folded from the old one is known not to belong to it."""
    info = await js.stream_info(subjects.EVENTS_STREAM)
    created = info.created.isoformat() if info.created else "unknown"
    return f"{info.config.name}@{created}", int(info.state.last_seq)


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
            # With the server gone, closing fails flushing what it could not send anyway.
            with contextlib.suppress(OSError, nats.errors.Error):
                await nc.close()
