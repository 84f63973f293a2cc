"""`berth backup` and `berth restore`: the events stream copied out of a running cluster and
replayed into a new one, whose services then show exactly the same jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from nats.aio.client import Client as NATS

from berth.shared import servers
from berth.shared.messages import JobSpec, Resources
from berth.stack import start_services
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_projection import accepted

SMALL = Resources(cpu=0.1, memory_mb=16)


def berth(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "berth.cli", *args], capture_output=True,
                          text=True, timeout=120)


async def test_a_backup_restored_into_a_new_cluster_shows_the_same_jobs(
        make_stack, nc: NATS, tmp_path: Path) -> None:
    stack = make_stack(workers=1)
    jobs = {
        await accepted(nc, JobSpec(name="ok", command=["true"], resources=SMALL)): "succeeded",
        await accepted(nc, JobSpec(name="bad", command=["false"], resources=SMALL)): "failed",
    }
    for job_id, state in jobs.items():
        await wait_for_job(stack, job_id, {state})
    shown = {job_id: get_json(stack, f"/api/jobs/{job_id}") for job_id in jobs}
    backup = tmp_path / "events.jsonl"
    made = berth("--data-dir", str(stack.data_dir), "backup", str(backup))
    assert made.returncode == 0, made.stderr

    data = tmp_path / "new-cluster"
    nats_server, redis_server = servers.start_nats(data), servers.start_redis(data)
    try:
        restored = berth("--data-dir", str(data), "--nats-url", nats_server.url, "restore",
                         str(backup))
        assert restored.returncode == 0, restored.stderr
        # Once is enough: a stream that holds events is never restored into.
        again = berth("--data-dir", str(data), "--nats-url", nats_server.url, "restore",
                      str(backup))
        assert again.returncode == 1 and "already holds" in again.stderr
        new = start_services(data / "berth", nats_server, redis_server, workers=0)
        try:
            await wait_until(lambda: get_json(new, "/healthz")["caught_up"],
                             what="the new dashboard to fold the restored log")
            for job_id in jobs:
                detail = httpx.get(f"{new.api_url}/api/jobs/{job_id}", timeout=10).json()
                assert detail == shown[job_id]
        finally:
            new.stop()
    finally:
        redis_server.stop()
        nats_server.stop()
