"""The dashboard's metrics: its projection's gauges (the fold, the workers' heartbeats and
GPUs) and the API's request latency (Litestar's Prometheus middleware)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from litestar.middleware.base import DefineMiddleware
from litestar.plugins.prometheus import PrometheusConfig
from prometheus_client.core import CounterMetricFamily, Metric

from berth.services.dashboard_api.projection import Projection
from berth.shared import metrics, nats_io

# Paths grouped by route (`/api/jobs/{job_id}`), not one series per job.
REQUESTS = PrometheusConfig(app_name="berth-dashboard", prefix="berth_dashboard",
                            group_path=True, exclude_unhandled_paths=True,
                            exclude=["^/static/", "^/metrics$"])


def middleware() -> DefineMiddleware:
    return REQUESTS.middleware


def instrument(projection: Projection) -> metrics.Refresh:
    """Registers the projection's gauges; returns what to refresh before each scrape."""
    stream_seq: list[int] = []

    async def refresh() -> None:
        stream_seq[:] = [await nats_io.last_event_seq(projection.js)]

    def collect() -> Iterator[Metric]:
        yield from metrics.state_metrics(projection.state, stream_seq[0] if stream_seq else None)
        yield CounterMetricFamily("berth_events_folded", metrics.EVENTS_FOLDED_HELP,
                                  projection.folded)
        yield metrics.gauge("berth_dashboard_caught_up",
                            "1 once the projection has folded the log as it stood at start",
                            1 if projection.caught_up.is_set() else 0)
        age = metrics.gauge("berth_worker_heartbeat_age_seconds",
                            "Seconds since the worker's latest heartbeat was sent",
                            labels=["worker"])
        now = time.time()
        for worker_id, sent in sorted(projection.last_heartbeat.items()):
            age.add_metric([worker_id], max(0.0, now - sent))
        yield age
        yield from metrics.device_metrics(projection.device_stats)

    metrics.register(collect)
    return refresh
