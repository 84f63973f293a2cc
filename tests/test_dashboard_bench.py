"""`bench/dashboard.py --quick`: a real nats-server holding a small history, the real
dashboard process catching up from sequence 0, answering every kind of request, and
saving its snapshot on a clean stop. The numbers are the benchmark's to report; what is checked
is that it ran through and folded the whole stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_dashboard_benchmark_catches_up_and_answers() -> None:
    done = subprocess.run([sys.executable, "bench/dashboard.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    # 1 leader, 100 workers, 10 jobs of 100 tasks: a submit and 4 events per task.
    assert report["events"] == 1 + 100 + 10 * (1 + 100 * 4)
    assert report["jobs"] == 10 and report["catch_up_events_per_s"] > 0
    assert report["snapshot_mib"] > 0 and report["dashboard_cpu_s"] > 0
    assert report["job_detail_p50_ms"] > 0 and report["task_detail_p50_ms"] > 0
