"""The dashboard_api process: the projection plus uvicorn serving the Litestar app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from services.dashboard_api.app import create_app
from services.dashboard_api.projection import Projection
from shared import nats_io, service
from shared.config import Settings

log = logging.getLogger("berth.dashboard")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: shared.service owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run(settings: Settings, stop: asyncio.Event) -> None:
    nc = await nats_io.connect(settings.nats_url, "berth-dashboard")
    js = nc.jetstream()
    await nats_io.ensure_streams(js)
    projection = Projection(nc, settings.worker_dead_after)
    await projection.start()
    config = uvicorn.Config(
        create_app(projection, js), host=settings.api_host, port=settings.api_port,
        log_level="warning", lifespan="on",
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
    service.run("dashboard", lambda stop: run(settings, stop))
