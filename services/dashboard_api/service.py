"""The dashboard_api process: the projection plus uvicorn serving the Litestar app."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from berth.services.dashboard_api import auth, metrics
from berth.services.dashboard_api.app import create_app
from berth.services.dashboard_api.projection import Projection
from berth.shared import api_tokens, asgi_server, dir_lock, nats_io, service
from berth.shared import metrics as shared_metrics
from berth.shared.config import Settings
from berth.shared.credentials import Role

log = logging.getLogger("berth.dashboard")


async def run(settings: Settings, tokens: auth.Tokens, closed_reads: bool,
              stop: asyncio.Event) -> None:
    nc = await nats_io.connect_service(settings, "berth-dashboard", Role.DASHBOARD)
    js = nc.jetstream()
    await nats_io.ensure_streams(js, settings.stream_replicas)
    projection = Projection(
        nc, settings.worker_dead_after,
        snapshot_path=Path(settings.data_dir) / "dashboard" / "projection.snapshot",
        snapshot_interval=settings.snapshot_interval,
        fair_share=settings.fair_share,
    )
    await projection.start()
    if not tokens.configured:
        log.warning("no API token exists (BERTH_API_TOKEN unset, %s empty): submit and cancel "
                    "over HTTP are off until one is minted", tokens.path)
    refresh = metrics.instrument(projection)
    try:
        serving = await asgi_server.start(
            create_app(projection, js, tokens, closed_reads, refresh),
            settings.api_host, settings.api_port)
        log.info("dashboard on http://%s:%d/", settings.api_host, settings.api_port)
        # Its /metrics is on the API port; a metrics port, when set, serves the same.
        metrics_serving = await shared_metrics.serve(settings.metrics_host,
                                                     settings.metrics_port, [refresh])
    except BaseException:
        await projection.stop()
        await nats_io.close(nc)
        raise
    try:
        await asyncio.wait([serving.task, asyncio.create_task(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if metrics_serving is not None:
            await metrics_serving.stop()
        await serving.stop()
        await projection.stop()
        await nats_io.close(nc)


def main() -> None:
    settings = Settings.from_env()
    # Before service.run, so what the checks below log is not lost (a second call is a no-op).
    service.setup_logging("dashboard")
    tokens = auth.Tokens(settings.api_token, Path(settings.api_tokens_file))
    try:
        tokens.load()
    except api_tokens.TokensFileError as exc:
        raise SystemExit(f"BERTH_API_TOKENS_FILE: {exc}") from None
    closed_why = auth.closed_reads_reason(settings.api_host, settings.api_closed_reads)
    if closed_why is not None and not tokens.configured:
        raise SystemExit(f"reads need a token ({closed_why}) and none exists: set "
                         f"BERTH_API_TOKEN or mint one with `berth token create NAME`")
    if closed_why is not None:
        log.info("reads need a bearer token: %s", closed_why)
    # One dashboard per data dir: its snapshot and durable consumer live there.
    try:
        lock = dir_lock.acquire(Path(settings.data_dir) / "dashboard.lock", "dashboard")
    except dir_lock.DirLocked as exc:
        raise SystemExit(f"berth dashboard: {exc}") from None
    try:
        service.run("dashboard", lambda stop: run(settings, tokens, closed_why is not None, stop))
    finally:
        lock.release()
