"""A benchmark stopped by SIGTERM (`timeout`, bench/many_cores.sh) tears down what it
started: the servers run in sessions of their own (shared/servers.py), so the signal does
not reach them, and Python's default for SIGTERM ends the process without running any
`finally`. Left running, a killed run's nats-server and valkey loaded every later one."""

from __future__ import annotations

import signal
import sys
from types import FrameType


def _stop(signum: int, frame: FrameType | None) -> None:
    print("stopped by SIGTERM: tearing down", file=sys.stderr)
    raise SystemExit(128 + signum)  # unwinds through every `finally` and `async with`


def tear_down_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _stop)
