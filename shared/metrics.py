"""Prometheus metrics (prometheus-client, docs/metrics.md): the metrics more than one
service keeps, the gauges read off a folded ClusterState, and the endpoint each service
serves at BERTH_METRICS_HOST:BERTH_METRICS_PORT (off unless a port is set).

Instrumentation stays beside the logic, not in it: counters are bumped from the services'
existing hooks (a tick's stats, a publish retry, a folded event), and gauges are computed
when scraped from state the service holds anyway, so a metric never changes a decision."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Counter, make_asgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from berth.shared.lifecycle import ClusterState
from berth.shared.messages import DeviceStats, Priority

if TYPE_CHECKING:
    from berth.shared.asgi_server import Serving

log = logging.getLogger("berth.metrics")

# Bounded: a scrape must answer even when NATS or Redis does not.
REFRESH_TIMEOUT = 2.0

PUBLISH_RETRIES = Counter(
    "berth_publish_retries", "Event publishes retried (no ack in time, or NATS unreachable)")
EVENTS_FOLDED_HELP = "Events-stream messages folded into this process's state"

Refresh = Callable[[], Awaitable[None]]


def pending_by_band(state: ClusterState) -> dict[str, int]:
    """Pending tasks per priority band, every band present (0 when none wait)."""
    counts = {band.value: 0 for band in Priority}
    for job_id, _ in state.pending:
        job = state.jobs.get(job_id)
        if job is not None:
            counts[job.spec.priority.value] += 1
    return counts


WORKER_STATES = ("in_service", "cordoned", "draining", "quarantined", "dead")


def workers_by_state(state: ClusterState) -> dict[str, int]:
    """Workers by state, every state present: dead, else why it takes no new work (the
    first word of shared/node_health.py's reason, which also decides which one wins),
    else in service."""
    counts = dict.fromkeys(WORKER_STATES, 0)
    for worker in state.workers.values():
        if not worker.alive:
            counts["dead"] += 1
        else:
            counts[worker.out_of_service.partition(":")[0] or "in_service"] += 1
    return counts


def gauge(name: str, doc: str, value: float | None = None,
          labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, labels=list(labels) or None)


def state_metrics(state: ClusterState, stream_last_seq: int | None) -> Iterator[Metric]:
    """What a fold of the events stream says: pending tasks by band, workers by state, the
    newest epoch, how far the fold has got and how far behind the stream it is."""
    pending = gauge("berth_pending_tasks", "Tasks waiting to be placed, by priority band",
                    labels=["band"])
    for band, n in pending_by_band(state).items():
        pending.add_metric([band], n)
    yield pending
    workers = gauge("berth_workers", "Workers known to the fold, by state", labels=["state"])
    for name, n in workers_by_state(state).items():
        workers.add_metric([name], n)
    yield workers
    yield gauge("berth_epoch", "The newest leader epoch the fold believes", state.epoch)
    yield gauge("berth_fold_seq", "Stream sequence of the last event folded", state.last_seq)
    if stream_last_seq is not None:
        yield gauge("berth_fold_lag", "Events stored in the stream but not folded yet",
                    max(0, stream_last_seq - state.last_seq))
    yield gauge("berth_refused_events",
                "Events-stream messages the fold did not believe (shared/event_origin.py)",
                state.refused_events)


def device_metrics(stats: dict[str, list[DeviceStats]]) -> Iterator[Metric]:
    """Per worker and device, the GPU figures its latest heartbeat carried (NVML): only
    those it reported (a host without NVML reports none)."""
    util = gauge("berth_gpu_utilization_percent",
                 "Share of the last sample period the GPU was busy", labels=["worker", "gpu"])
    mem = gauge("berth_gpu_memory_used_bytes", "GPU memory in use", labels=["worker", "gpu"])
    temp = gauge("berth_gpu_temperature_celsius", "GPU temperature", labels=["worker", "gpu"])
    for worker_id, devices in sorted(stats.items()):
        for d in devices:
            key = [worker_id, str(d.index)]
            if d.utilization is not None:
                util.add_metric(key, d.utilization)
            if d.memory_used_mb is not None:
                mem.add_metric(key, d.memory_used_mb * 1024 * 1024)
            if d.temperature_c is not None:
                temp.add_metric(key, d.temperature_c)
    yield from (util, mem, temp)


class Gauges(Collector):
    """Gauges computed at scrape time by `collect` (a service's own view of its state).
    Scrapes run on the service's event loop (the endpoint is served there), so reading
    the state never races the code that changes it."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())


def register(collect: Callable[[], Iterable[Metric]]) -> Gauges:
    """Adds scrape-time gauges to this process's registry."""
    gauges = Gauges(collect)
    REGISTRY.register(gauges)
    return gauges


async def refresh_all(refreshes: Iterable[Refresh]) -> None:
    """Reads what gauges need from NATS or Redis before a scrape; a source that does not
    answer in time leaves its gauge out (or stale), never the scrape unanswered."""
    for refresh in refreshes:
        try:
            await asyncio.wait_for(refresh(), REFRESH_TIMEOUT)
        except Exception as exc:
            log.debug("a metrics refresh failed: %s", exc)


def asgi_app(refreshes: Iterable[Refresh] = ()) -> Callable[..., Awaitable[None]]:
    """/metrics in Prometheus's text format, after the refreshes; 404 elsewhere."""
    exposition = make_asgi_app(REGISTRY)
    refreshes = list(refreshes)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"metrics are at /metrics\n"})
            return
        await refresh_all(refreshes)
        await exposition(scope, receive, send)

    return app


async def serve(host: str, port: int, refreshes: Iterable[Refresh] = ()
                ) -> Serving | None:
    """The metrics endpoint, if a port is configured (BERTH_METRICS_PORT); None if not."""
    if not port:
        return None
    # Imported here: the `berth` command imports this module (through nats_io) and has no
    # server to run.
    from berth.shared import asgi_server

    serving = await asgi_server.start(asgi_app(refreshes), host, port, lifespan="off")
    log.info("metrics on http://%s:%d/metrics", host, port)
    return serving
