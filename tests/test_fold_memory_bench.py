"""`bench/fold_memory.py --quick`: the bytes the fold keeps per finished job are the
benchmark's to report; what is checked is that it folded every job to its end, and that a
finished one-task job keeps no list but its tasks and attempts, and no dict,
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
    # A job's tasks and its one task's attempts: the only lists a fold keeps per job (its
    # children and dependents are tuples, the shared empty one when it has none).
    assert report["objects_per_job"]["list"] <= 2, report["objects_per_job"]
    # A one-task job keeps no dict of counts per state, and its empty maps (env, tokens,
    # ports) are one shared object: it keeps no dict of its own.
    assert report["objects_per_job"].get("dict", 0) < 1, report["objects_per_job"]
    # The records themselves are not tracked by the cyclic collector (msgspec gc=False):
    # what is left is those two lists (and a few objects not per job).
    assert report["gc_tracked_per_job"] < 2.5, report
    # The submissions alone, folded and filed in the scheduler's pending queue.
    assert report["waiting"] == 2000 and report["bytes_per_waiting_job"] > 0, report
