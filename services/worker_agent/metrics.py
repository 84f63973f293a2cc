"""The worker agent's metrics (docs/metrics.md): heartbeats answered, reports sent, and per
worker what it runs, how long its fence has left and its GPUs' figures."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import Counter
from prometheus_client.core import Metric

from berth.shared import metrics
from berth.shared.states import TaskState

if TYPE_CHECKING:
    from berth.services.worker_agent.service import WorkerAgent

HEARTBEATS = Counter("berth_worker_heartbeats",
                     "Heartbeats sent for an answer, by outcome (acknowledged, unanswered)",
                     ["outcome"])
REPORTS = Counter("berth_worker_reports", "Attempt reports published, by state", ["state"])
# Looked up once (`labels` validates and locks per call; a simulated host process makes
# thousands of reports a second); each series reads 0 before its first.
HEARTBEATS_ACKNOWLEDGED = HEARTBEATS.labels("acknowledged")
HEARTBEATS_UNANSWERED = HEARTBEATS.labels("unanswered")
REPORTS_BY_STATE = {state: REPORTS.labels(state.name.lower()) for state in TaskState}


def instrument(agents: Sequence[WorkerAgent]) -> None:
    """Registers the gauges over this process's agents (one, or many simulated hosts)."""

    def collect() -> Iterator[Metric]:
        running = metrics.gauge("berth_worker_attempts_running",
                                "Attempts the agent runs (building or running)",
                                labels=["worker"])
        fence = metrics.gauge("berth_worker_fence_remaining_seconds",
                              "Seconds before the agent's tasks are fenced unless the leader "
                              "acknowledges a heartbeat", labels=["worker"])
        refused = metrics.gauge("berth_worker_refused_commands",
                                "Commands refused (stale epoch or incarnation)",
                                labels=["worker"])
        now = time.monotonic()
        for agent in agents:
            running.add_metric([agent.worker_id], len(agent.running))
            fence.add_metric([agent.worker_id], max(0.0, agent.fence_deadline - now))
            refused.add_metric([agent.worker_id], agent.refused_commands)
        yield from (running, fence, refused)
        yield from metrics.device_metrics({a.worker_id: a.gpu_watch.stats for a in agents
                                           if a.gpu_watch is not None})

    metrics.register(collect)
