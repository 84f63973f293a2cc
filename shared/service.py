"""Running a service process: logging, tracing, and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from shared import telemetry


def setup_logging(service: str) -> None:
    logging.basicConfig(
        level=os.environ.get("BERTH_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(service: str, main: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Runs `main(stop)` until it returns; SIGTERM/SIGINT set `stop` so it can shut down
    cleanly, and a second signal cancels it outright."""
    setup_logging(service)
    telemetry.setup_tracing(f"berth-{service}")

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_signal() -> None:
            if stop.is_set() and task is not None:
                task.cancel()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await main(stop)

    try:
        asyncio.run(runner())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    finally:
        telemetry.shutdown_tracing()
        logging.getLogger(service).info("stopped")


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleeps up to `seconds`; returns True if `stop` was set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
        return True
    except TimeoutError:
        return False
