"""The scheduler's metrics (docs/metrics.md). The service calls the counters from the
points where it already measures or logs (a tick's stats, a refused commit, a late
renewal, a term's end); the gauges are read off the current term when scraped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from berth.shared import metrics, nats_io
from berth.shared.reservations import ReservationStore

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from berth.services.scheduler.service import Leader

PLACEMENTS = Counter("berth_scheduler_placements",
                     "Tasks placed: reserved in Redis by a tick's commit")
COMMIT_REFUSALS = Counter("berth_scheduler_commit_refusals",
                          "Tick commits Redis refused, by reason (conflict, stale_epoch)",
                          ["reason"])
TICK_SECONDS = Histogram("berth_scheduler_tick_seconds",
                         "Duration of a scheduling tick with pending work",
                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                  1.0, 2.5, 5.0))
LEASE_RENEWALS_LATE = Counter("berth_scheduler_lease_renewals_late",
                              "Lease renewals that ran late (the event loop was held)")
LEASE_LAPSED = Counter("berth_scheduler_lease_lapsed",
                       "Times the lease may have lapsed by this scheduler's own clock")
TERMS = Counter("berth_scheduler_terms", "Terms of leadership won")
TERMS_ENDED = Counter("berth_scheduler_terms_ended",
                      "Terms of leadership ended, by what ended them", ["reason"])


def tick_done(seconds: float, placed: int) -> None:
    TICK_SECONDS.observe(seconds)
    PLACEMENTS.inc(placed)


def term_ended(exc: BaseException) -> None:
    TERMS_ENDED.labels(type(exc).__name__).inc()


class Term:
    """The scheduler's current term (None while standing by), for the scrape-time gauges."""

    def __init__(self) -> None:
        self.leader: Leader | None = None
        self.stream_seq: int | None = None
        self.refused_double_bookings: int | None = None
        self.folded_earlier = 0  # events folded by the terms that ended


def instrument(term: Term, js: JetStreamContext, store: ReservationStore
               ) -> metrics.Refresh:
    """Registers the gauges over `term`; returns what to refresh before each scrape."""

    async def refresh() -> None:
        term.refused_double_bookings = await store.refused_double_bookings()
        term.stream_seq = await nats_io.last_event_seq(js)

    def collect() -> Iterator[Metric]:
        leader = term.leader
        yield metrics.gauge("berth_scheduler_leader", "1 while this scheduler leads",
                            1 if leader is not None else 0)
        yield CounterMetricFamily("berth_events_folded", metrics.EVENTS_FOLDED_HELP,
                                  term.folded_earlier + (leader.folded if leader else 0))
        if term.refused_double_bookings is not None:
            yield metrics.gauge(
                "berth_refused_double_bookings",
                "Commits Redis refused because a host would have been booked twice "
                "(cluster-wide, kept in Redis; must stay 0)", term.refused_double_bookings)
        if leader is None:
            return
        yield metrics.gauge("berth_scheduler_term_epoch", "This leader's epoch", leader.epoch)
        yield metrics.gauge("berth_heartbeat_interval_seconds",
                            "The heartbeat interval this leader asks of every worker "
                            "(BERTH_HEARTBEAT_RATE)", leader.heartbeat_pace)
        yield from metrics.state_metrics(leader.state, term.stream_seq)
        age = metrics.gauge("berth_worker_heartbeat_age_seconds",
                            "Seconds since the leader last heard the worker's heartbeat",
                            labels=["worker"])
        now = time.monotonic()
        for worker in leader.state.workers.values():
            heard = leader.last_heartbeat.get(worker.worker_id)
            if worker.alive and heard is not None:
                age.add_metric([worker.worker_id], max(0.0, now - heard))
        yield age

    metrics.register(collect)
    return refresh
