"""Taking the leader lease so that epochs stay unique across a Redis failover, and waiting
out a Redis outage without dying.

Redis's epoch key is the fence, but a replica promoted by Sentinel may have missed the last
increment: the epoch it hands out next may be one a leader already used. The event log
(JetStream, replicated on its own) remembers every `leader_elected`, so a new leader takes
an epoch above the newest one logged (docs/invariants.md, invariant 11), and logs its own only if no
other leader was logged in between."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext

from berth.shared import nats_io, subjects
from berth.shared.event_origin import MAX_EPOCH_STEP, believed_epoch
from berth.shared.messages import LeaderElected, encode
from berth.shared.reservations import ReservationStore

log = logging.getLogger("berth.scheduler")

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when that expectation fails
# JetStream's answer to a retry while the first publish with its message id is still being
# stored (a stream electing a leader after a NATS partition): ask again, it settles.
DUPLICATE_IN_PROCESS = 10158


def epoch_floor(*known: int | None) -> int:
    """The highest epoch known to be used already (None: a source that knows none)."""
    return max((e for e in known if e is not None), default=0)


def needs_fresh_epoch(epoch: int, floor: int) -> bool:
    """An epoch not above one already used may be shared with another leader."""
    return epoch <= floor


@dataclass(frozen=True)
class Lease:
    """A won lease: the epoch; the stream sequence of the newest `leader_elected` when the
    floor was read (0: none), after which this term's own must come directly; and when
    (CLOCK_MONOTONIC) the call that won it was sent, from which its TTL surely runs."""

    epoch: int
    after_seq: int
    sent: float


class Superseded(Exception):
    """Another leader's `leader_elected` reached the log after this one read its floor."""


async def newest_leader(js: JetStreamContext) -> tuple[int, int]:
    """(epoch, stream sequence) of the newest `leader_elected` in the event log, (0, 0) if
    none. The epoch is the highest one a fold believes (shared/event_origin.py), so a
    forged or mistaken epoch of 10^9 is no floor; the sequence is the newest message's,
    believed or not (announce checks that none came after it)."""
    try:
        stored = await js.get_last_msg(subjects.EVENTS_STREAM, subjects.LEADER_EVENTS)
    except nats.js.errors.NotFoundError:
        return 0, 0
    seq = stored.seq or 0
    epochs = []
    for msg in await nats_io.read_subject(js, subjects.EVENTS_STREAM, subjects.LEADER_EVENTS):
        event = nats_io.raw_event(msg).record().event
        if isinstance(event, LeaderElected):
            epochs.append(event.epoch)
    return believed_epoch(epochs), seq


async def take_lease(store: ReservationStore, js: JetStreamContext, scheduler_id: str,
                     ttl_ms: int, folded: int = 0) -> Lease | None:
    """The lease if this scheduler holds it, with an epoch above every epoch in the log and
    `folded` (the highest this process has seen); None while another holds it."""
    sent = time.monotonic()
    epoch = await store.acquire_lease(scheduler_id, ttl_ms)
    if not epoch:
        return None
    newest, after_seq = await newest_leader(js)
    floor = epoch_floor(newest, folded)
    if needs_fresh_epoch(epoch, floor):
        log.info("epoch %d from Redis is not above %d, the newest the event log knows; "
                 "taking a fresh one above it", epoch, floor)
        sent = time.monotonic()
        epoch = await store.acquire_lease(scheduler_id, ttl_ms, floor)
        if not epoch:
            return None
    if epoch > floor + MAX_EPOCH_STEP:
        # Only by hand (Redis's admin user): no fold will believe this term's
        # leader_elected, so the log cannot void a deposed leader's late assignments.
        log.error("epoch %d from Redis is more than %d above %d, the newest the event log "
                  "believes; leading, but the log will refuse this term's leader_elected "
                  "(docs/reliability.md)", epoch, MAX_EPOCH_STEP, floor)
    return Lease(epoch, after_seq, sent)


async def announce(js: JetStreamContext, scheduler_id: str, lease: Lease) -> int:
    """Logs `leader_elected` for this term, only if no other came since the floor was read
    (JetStream checks the subject's last sequence), so the epochs of the leader events
    strictly increase along the log: a leader that read its floor before another announced
    cannot announce (nor act) after it. Returns the event's stream sequence."""
    event = LeaderElected(scheduler_id=scheduler_id, epoch=lease.epoch, ts=time.time())
    # Unique per term even if an epoch were ever handed out twice: a repeated id would be
    # dropped by JetStream's dedup, and the second leader go unlogged.
    headers = {**nats_io.message_headers(f"leader:{lease.epoch}:{scheduler_id}"),
               EXPECTED_LAST_SUBJECT_SEQ: str(lease.after_seq)}
    payload = encode(event)
    tries = 0
    while True:
        tries += 1
        try:
            # Not publish_async: it reports a refused expectation to the error callback and
            # never resolves the ack.
            ack = await js.publish(subjects.LEADER_EVENTS, payload, stream=subjects.EVENTS_STREAM,
                                   headers=headers)
            return int(ack.seq)
        except nats.js.errors.APIError as exc:
            if exc.err_code == DUPLICATE_IN_PROCESS:
                await asyncio.sleep(min(0.1 * tries, 2.0))
                continue
            if exc.err_code != WRONG_LAST_SEQUENCE:
                raise
            break
        except nats_io.RETRIABLE as exc:
            log.warning("logging leader_elected failed (%s); retrying", exc)
            await asyncio.sleep(min(0.1 * tries, 2.0))
    # The check comes before dedup: a retry of a publish whose ack was lost lands here too,
    # and finds its own event the newest.
    stored = await js.get_last_msg(subjects.EVENTS_STREAM, subjects.LEADER_EVENTS)
    record = nats_io.RawEvent(stored.seq or 0, stored.data or b"", {},
                              stored.subject or "").record()
    if isinstance(record.event, LeaderElected) and (
            record.event.scheduler_id, record.event.epoch) == (scheduler_id, lease.epoch):
        return stored.seq or 0
    raise Superseded(f"another leader was logged after epoch floor (stream sequence "
                     f"{lease.after_seq}) was read")


class Backoff:
    """Exponential backoff with jitter for retrying an unreachable Redis: the first retry
    comes soon (a failover takes seconds), later ones no more often than every `cap`
    seconds, and schedulers that lost Redis together do not all come back in step."""

    def __init__(self, initial: float = 0.2, cap: float = 2.0, factor: float = 2.0,
                 rng: random.Random | None = None) -> None:
        self.initial = initial
        self.cap = cap
        self.factor = factor
        self.rng = rng or random.Random()
        self.current = initial

    def next(self) -> float:
        """The next delay: somewhere in [d/2, d], with d doubling up to `cap`."""
        d = self.current
        self.current = min(self.cap, d * self.factor)
        return d / 2 + self.rng.uniform(0, d / 2)

    def reset(self) -> None:
        self.current = self.initial


class Outage:
    """Logs an outage (unreachable, or no replica acknowledging) once when it starts, a
    reminder now and then, and once when it ends: never a line (or a traceback) per retry."""

    REMIND_EVERY = 30.0

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None
        self.reminded = 0.0

    def failed(self, exc: BaseException, doing: str = "not leading") -> None:
        now = time.monotonic()
        reason = str(exc) or exc.__class__.__name__
        if self.since is None:
            self.since = self.reminded = now
            log.warning("%s unavailable (%s); %s, retrying", self.what, reason, doing)
        elif now - self.reminded >= self.REMIND_EVERY:
            self.reminded = now
            log.warning("%s still unavailable after %.0f s (%s)", self.what, now - self.since,
                        reason)

    def recovered(self) -> None:
        if self.since is not None:
            log.info("%s available again after %.1f s", self.what, time.monotonic() - self.since)
            self.since = None
