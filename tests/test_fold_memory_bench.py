"""`bench/fold_memory.py --quick`: the bytes the fold keeps per finished job are the
benchmark's to report; what is checked is that it folded every job to its end, and that a
finished one-task job keeps no empty list of its own (each is a shared empty tuple now),
and that its records are not among the objects a full garbage collection walks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_fold_memory_benchmark_folds_every_job_to_its_end() -> None:
    done = subprocess.run([sys.executable, "bench/fold_memory.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[0])
    assert report["jobs"] == report["finished"] == 2000
    assert report["fold_bytes_per_job"] > 0 and report["us_per_event_decode_and_fold"] > 0
    # A job's tasks, its one task's attempts, and its children and dependents: the lists a
    # fold still keeps per job.
    assert report["objects_per_job"]["list"] <= 4, report["objects_per_job"]
    # The records themselves are not tracked by the cyclic collector (msgspec gc=False):
    # what is left is those lists and the job's count of tasks per state.
    assert report["gc_tracked_per_job"] <= 6, report
