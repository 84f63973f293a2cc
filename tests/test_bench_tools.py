"""Two benchmark tools kept from rotting: `bench/follow.py` in each of its modes (a small run,
its JSON line well formed; the numbers are the benchmark's to report), and a benchmark
stopped by SIGTERM, as `timeout` stops one, leaving none of its servers running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def servers_of(pid: int) -> set[int]:
    """The nats-server and valkey-server processes `pid` started (its children: they run in
    sessions of their own, but their parent is the benchmark until it ends)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        parent = next(line.split()[1] for line in status.splitlines()
                      if line.startswith("PPid:"))
        if int(parent) == pid and name in ("nats-server", "valkey-server"):
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text()
                     .splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return state != "Z"


def test_a_benchmark_stopped_by_sigterm_leaves_no_server_running() -> None:
    # A W1 far longer than the test: it is stopped while it runs.
    bench = subprocess.Popen([sys.executable, "bench/scale.py", "--only", "W1", "--hosts",
                              "20", "--jobs", "1000000"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(servers := servers_of(bench.pid)) < 2:  # nats-server and valkey
            assert bench.poll() is None, bench.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the benchmark's servers never started"
            time.sleep(0.1)
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM: tearing down" in err
    deadline = time.monotonic() + 15
    while (left := {pid for pid in servers if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == set()
