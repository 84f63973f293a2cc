"""Running a service process: logging, tracing, and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import cProfile
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from berth.shared import config, telemetry
from berth.shared.log_format import JsonFormatter


def setup_logging(service: str) -> None:
    # No format of berth's names a log call's file, line, function, thread or process, so
    # they are not looked up for every record (the logging HOWTO's "Optimization"): a third
    # of a log call, and the submitter logs every job it accepts.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if config.log_format() == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(service))
        logging.basicConfig(level=config.log_level(), handlers=[handler])
        return
    logging.basicConfig(
        level=config.log_level(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# A stop that takes longer than this is stuck (seen: a client library task that would not
# end once its server was gone): the process exits anyway, so a supervisor never waits.
STOP_DEADLINE = 20.0


def run(service: str, main: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Runs `main(stop)` until it returns; SIGTERM/SIGINT set `stop` so it can shut down
    cleanly, a second signal cancels it outright, and a stop still not done after
    STOP_DEADLINE seconds exits the process."""
    setup_logging(service)
    telemetry.setup_tracing(f"berth-{service}")
    log = logging.getLogger(service)
    tune_gc()

    def exit_now() -> None:
        log.error("did not stop within %gs; exiting", STOP_DEADLINE)
        logging.shutdown()
        os._exit(1)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_signal() -> None:
            if stop.is_set() and task is not None:
                task.cancel()
            else:
                # A thread, not the loop: the loop may be what is stuck.
                deadline = threading.Timer(STOP_DEADLINE, exit_now)
                deadline.daemon = True
                deadline.start()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await main(stop)

    profiler = _start_profile()
    try:
        asyncio.run(runner())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(os.path.join(config.profile_dir(), f"{service}-{os.getpid()}.prof"))
        telemetry.shutdown_tracing()
        log.info("stopped")


def _start_profile() -> cProfile.Profile | None:
    if not config.profile_dir():
        return None
    os.makedirs(config.profile_dir(), exist_ok=True)
    # The main thread's CPU clock, not the wall clock: on a machine whose cores the cluster
    # shares, a wall clock charges a function for the time others ran while it was
    # preempted (a loopback write that wakes its reader read as the write's cost).
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    return profiler


def tune_gc() -> None:
    """Services hold hundreds of thousands of long-lived objects (the fold). With Python's
    default thresholds the cyclic collector ran so often over them that a scheduler tick
    at 10,000 hosts took 0.8 s instead of 0.3 s; collections are rarer now (docs/performance.md).
    Generation 1 is collected every 5 young collections, not 20: nearly every tracked
    object a busy fold makes survives, so at 20 it held up to a million of them and one
    collection held a 10,000-host scheduler 0.52 s; the full collection stays as rare
    (every 400 young ones, as at 20 x 20). Objects alive at start-up (modules, settings)
    are frozen out of every collection."""
    gc.set_threshold(50_000, 5, 80)
    gc.freeze()
    if _time_collections not in gc.callbacks:
        gc.callbacks.append(_time_collections)


# A collection that holds the event loop this long is logged: a leader's lease is renewed
# every third of its TTL, so a pause of a second or more is what makes a renewal late.
SLOW_COLLECTION = 0.25
_collection_started = 0.0


def _time_collections(phase: str, info: dict[str, int]) -> None:
    global _collection_started
    if phase == "start":
        _collection_started = time.perf_counter()
        return
    took = time.perf_counter() - _collection_started
    if took >= SLOW_COLLECTION:
        logging.getLogger("berth.gc").warning(
            "garbage collection of generation %d held the process %.2f s (%d collected)",
            info.get("generation", -1), took, info.get("collected", 0))


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Waits up to `seconds` for `event`; True if it was set. In the calling task: on
    Python 3.11 `asyncio.wait_for` runs the wait as a task of its own and cancels it on
    timeout, which was a tenth of the CPU of 10,000 simulated hosts, each sleeping between
    heartbeats (docs/performance.md)."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], again_after: float = 1.0
                          ) -> None:
    """Cancels `tasks` and waits for every one to end, cancelling those still running
    again every `again_after` seconds; what they raised is read (and dropped). On Python
    3.11 `asyncio.wait_for`, which nats-py's requests use, returns its result and drops
    a cancellation that lands as its wait ends; a task in a loop then goes on for good.
    A leader's term end once waited for such a task forever: it neither led (its lease
    was gone) nor stood by for a new term, and its cluster had no leader."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=again_after)
        for task in done:
            if not task.cancelled():
                task.exception()


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleeps up to `seconds`; returns True if `stop` was set meanwhile."""
    return await wait_event(stop, seconds)
