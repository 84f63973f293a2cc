"""Taking the leader lease so that epochs stay unique across a Redis failover, and waiting
out a Redis outage without dying.

Redis's epoch key is the fence, but a replica promoted by Sentinel may have missed the last
increment: the epoch it hands out next may be one a leader already used. The event log
(JetStream, replicated on its own) remembers every `leader_elected`, so a new leader takes
an epoch above the newest one logged (DESIGN.md invariant 11)."""

from __future__ import annotations

import logging
import random
import time

import nats.js.errors
from nats.js import JetStreamContext

from shared import nats_io, subjects
from shared.messages import LeaderElected
from shared.reservations import ReservationStore

log = logging.getLogger("berth.scheduler")


def epoch_floor(*known: int | None) -> int:
    """The highest epoch known to be used already (None: a source that knows none)."""
    return max((e for e in known if e is not None), default=0)


def needs_fresh_epoch(epoch: int, floor: int) -> bool:
    """An epoch not above one already used may be shared with another leader."""
    return epoch <= floor


async def newest_logged_epoch(js: JetStreamContext) -> int:
    """The epoch of the newest `leader_elected` in the event log (0 if none). Should that
    message be one no fold believes, every leader event is read and the highest believed
    one counts."""
    try:
        stored = await js.get_last_msg(subjects.EVENTS_STREAM, subjects.LEADER_EVENTS)
    except nats.js.errors.NotFoundError:
        return 0
    record = nats_io.RawEvent(stored.seq or 0, stored.data or b"",
                              dict(stored.headers or {}), stored.subject or "").record()
    if isinstance(record.event, LeaderElected):
        return record.event.epoch
    epochs = []
    for msg in await nats_io.read_subject(js, subjects.EVENTS_STREAM, subjects.LEADER_EVENTS):
        event = nats_io.raw_event(msg).record().event
        if isinstance(event, LeaderElected):
            epochs.append(event.epoch)
    return epoch_floor(*epochs)


async def take_lease(store: ReservationStore, js: JetStreamContext, scheduler_id: str,
                     ttl_ms: int, folded: int = 0) -> int:
    """This scheduler's epoch if it holds the lease (above every epoch in the log and
    `folded`, the highest this process has seen), else 0."""
    epoch = await store.acquire_lease(scheduler_id, ttl_ms)
    if not epoch:
        return 0
    floor = epoch_floor(await newest_logged_epoch(js), folded)
    if not needs_fresh_epoch(epoch, floor):
        return epoch
    log.info("epoch %d from Redis is not above %d, the newest the event log knows; taking "
             "a fresh one above it", epoch, floor)
    return await store.acquire_lease(scheduler_id, ttl_ms, floor)


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
