"""Stopping berth when its servers are already gone."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from berth.shared.service import STOP_DEADLINE
from berth.stack import start_stack


def test_every_service_stops_cleanly_after_nats_went_away(tmp_path: Path) -> None:
    # Seen in the scale benchmark: a service whose NATS server was gone did not stop on
    # SIGTERM (the worker retried its last event for minutes; closing the client raised).
    stack = start_stack(tmp_path / "berth", workers=1)
    try:
        time.sleep(4)  # every service connected and serving
        stack.nats.stop()
        time.sleep(1)
        children = dict(stack.children)
        for proc in children.values():
            proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        for label, proc in children.items():
            code = proc.wait(timeout=STOP_DEADLINE + 10)
            log = (stack.data_dir / "logs" / f"{label}.log").read_text()
            assert code == 0, f"{label} exited with {code}:\n{log[-1500:]}"
            assert "did not stop within" not in log
        assert time.monotonic() - started < STOP_DEADLINE
    finally:
        stack.stop()
