"""Two benchmark tools kept from rotting: `bench/follow.py` in each of its modes (a small run,
its JSON line well formed; the numbers are the benchmark's to report), and a benchmark
stopped by SIGTERM, as `timeout` stops one, leaving nothing it started running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from berth.services.worker_agent import supervise

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("flags", "name"), [([], "follow_events"),
                                             (["--raw"], "follow_raw_events"),
                                             (["--durable"], "durable_feed")])
def test_the_follow_benchmark_reads_every_event_in_each_mode(flags: list[str],
                                                             name: str) -> None:
    done = subprocess.run([sys.executable, "bench/follow.py", "--events", "3000", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == name
    assert result["events"] == 3000
    assert result["cpu_us_per_event"] > 0 and result["events_per_s"] > 0


def children_of(pid: int) -> set[int]:
    """The processes `pid` started: its servers (in sessions of their own, but its children
    until it ends), services and simulated hosts."""
    found = supervise.children_of(pid)
    return set(supervise.walk_proc(pid) if found is None else found)


def is_server(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/comm").read_text().strip()
                in ("nats-server", "valkey-server"))
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        state = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text()
                     .splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return state != "Z"


@pytest.mark.parametrize("when", ["starting", "running"])
def test_a_benchmark_stopped_by_sigterm_leaves_nothing_running(tmp_path: Path,
                                                               when: str) -> None:
    """Stopped as its first server comes up (the others may be starting), or once all run:
    every process it started is stopped."""
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err_file:
        # A W1 far longer than the test: it is stopped while it runs.
        bench = subprocess.Popen([sys.executable, "bench/scale.py", "--only", "W1", "--hosts",
                                  "20", "--jobs", "1000000"], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=err_file)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        servers = 1 if when == "starting" else 2  # nats-server, then valkey
        while sum(map(is_server, seen)) < servers:
            assert bench.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the benchmark's servers never started"
            seen |= children_of(bench.pid)
            time.sleep(0.02)
        if when == "running":
            time.sleep(1.0)
        bench.send_signal(signal.SIGTERM)
        while bench.poll() is None:  # anything it starts before it ends is its to stop
            seen |= children_of(bench.pid)
            assert time.monotonic() < deadline + 60, "the benchmark did not end"
            time.sleep(0.02)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    err = err_path.read_text()
    assert bench.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM: tearing down" in err
    deadline = time.monotonic() + 15
    while (left := {pid for pid in seen if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == set()
