"""Serving an ASGI app with uvicorn inside a service's own event loop (the dashboard's API,
every service's metrics endpoint)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import uvicorn


class Server(uvicorn.Server):
    """uvicorn without its own signal handlers: berth.shared.service owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Serving:
    """A started server; `stop` ends it (open connections get `grace` seconds)."""

    def __init__(self, server: Server, task: asyncio.Task[None]) -> None:
        self.server = server
        self.task = task

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start(app: Any, host: str, port: int, grace: int = 2,
                lifespan: Literal["on", "off"] = "on") -> Serving:
    """Serves `app` on host:port; returns once it listens (raises SystemExit, one line, if
    it cannot: e.g. the port is taken). `grace`: live streams (SSE, followed logs) never
    end by themselves, so a stop cuts them after it."""
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   lifespan=lifespan, timeout_graceful_shutdown=grace))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            # uvicorn logs the reason (address in use) and exits the serve call.
            raise SystemExit(f"cannot serve on {host}:{port} (see the line above)")
        await asyncio.sleep(0.01)
    return Serving(server, task)
