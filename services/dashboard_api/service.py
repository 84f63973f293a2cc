"""The dashboard_api process: the projection plus uvicorn serving the Litestar app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from services.dashboard_api.app import create_app
from services.dashboard_api.projection import Projection
from shared import dir_lock, nats_io, service
from shared.config import Settings
from shared.credentials import Role

log = logging.getLogger("berth.dashboard")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: shared.service owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run(settings: Settings, stop: asyncio.Event) -> None:
    nc = await nats_io.connect_service(settings, "berth-dashboard", Role.DASHBOARD)
    js = nc.jetstream()
    await nats_io.ensure_streams(js)
    projection = Projection(
        nc, settings.worker_dead_after,
        snapshot_path=Path(settings.data_dir) / "dashboard" / "projection.snapshot",
        snapshot_interval=settings.snapshot_interval,
    )
    await projection.start()
    if not settings.api_token:
        log.warning("BERTH_API_TOKEN is not set: submit and cancel over HTTP are disabled")
    config = uvicorn.Config(
        create_app(projection, js, settings.api_token, settings.api_closed_reads),
        host=settings.api_host, port=settings.api_port, log_level="warning", lifespan="on",
        # Live streams (SSE, followed logs) never end by themselves.
        timeout_graceful_shutdown=2,
    )
    server = _Server(config)
    serving = asyncio.create_task(server.serve())
    log.info("dashboard on http://%s:%d/", settings.api_host, settings.api_port)
    try:
        await asyncio.wait([serving, asyncio.create_task(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        server.should_exit = True
        await serving
        await projection.stop()
        await nats_io.close(nc)


def main() -> None:
    settings = Settings.from_env()
    if settings.api_closed_reads and not settings.api_token:
        raise SystemExit("BERTH_API_CLOSED_READS needs BERTH_API_TOKEN: reads would be "
                         "closed to everyone")
    # One dashboard per data dir: its snapshot and durable consumer live there.
    try:
        lock = dir_lock.acquire(Path(settings.data_dir) / "dashboard.lock", "dashboard")
    except dir_lock.DirLocked as exc:
        raise SystemExit(f"berth dashboard: {exc}") from None
    try:
        service.run("dashboard", lambda stop: run(settings, stop))
    finally:
        lock.release()
