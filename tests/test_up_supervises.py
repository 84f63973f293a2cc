"""`berth up` as a user runs it, supervising its children (issue 17 item 4): a worker agent
SIGKILLed under a running task is started again, the task's attempt is written off
(worker_failed) and a new attempt succeeds, the stack stays up, `berth health` says so; a
clean stop still leaves no process behind (checked by PID). Started with `--metrics`: every
child's metrics URL is printed, and the restarted worker serves its metrics again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
from litestar.testing import AsyncTestClient
from nats.aio.client import Client as NATS

from berth.services.dashboard_api import auth
from berth.services.dashboard_api.app import create_app
from berth.services.dashboard_api.projection import Projection
from berth.stack_info import read_stack_info
from tests.conftest import wait_until
from tests.test_cli import BERTH, run_berth
from tests.test_packaging import in_a_poisoned_project  # noqa: F401  (autouse: issue 17 item 6)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _scrape(url: str) -> str | None:
    try:
        return httpx.get(url, timeout=5).text
    except httpx.TransportError:
        return None  # not listening yet


def _children(data_dir: Path) -> dict[str, Any]:
    kids: dict[str, Any] = read_stack_info(data_dir).get("children", {})
    return kids


async def test_a_killed_worker_is_restarted_its_task_retried_and_the_stack_stays_up(
        tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    env = {**os.environ, "BERTH_HEARTBEAT_INTERVAL": "0.5", "BERTH_WORKER_DEAD_AFTER": "3",
           "BERTH_KILL_GRACE": "2"}
    err = (tmp_path / "up.err").open("wb")
    up = await asyncio.create_subprocess_exec(
        *BERTH, "--data-dir", str(data_dir), "up", "--workers", "1", "--metrics",
        stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        await wait_until(lambda: "local-0" in _children(data_dir), 60, "berth up to start")
        info = read_stack_info(data_dir)
        # --metrics: a URL per child, printed and kept in stack.json; each one answers.
        urls = info["metrics_urls"]
        assert set(urls) == {"submitter", "scheduler", "dashboard", "local-0"}
        # Printed once everything has started, a moment after stack.json lists it.
        summary = tmp_path / "up.err"
        await wait_until(lambda: "berth is up" in summary.read_text(), 30, "the summary")
        printed = summary.read_text()
        assert all(f"metrics    {label:<10} {url}" in printed for label, url in urls.items())
        # The dashboard answering (what `berth up` waits for) says nothing of the submitter's
        # metrics server, which it opens only once its consumer is made: under load that
        # came later, and a single scrape failed the test once.
        scraped = await wait_until(lambda: _scrape(urls["submitter"]), 30, "submitter metrics")
        assert "berth_submits_total" in scraped
        api = info["api_url"]
        token = (data_dir / "api-token").read_text().strip()
        # The first attempt leaves a mark and runs until killed; the retry finds the mark.
        mark = tmp_path / "first-attempt-ran"
        spec = {"name": "survivor", "resources": {"cpu": 0.5, "memory_mb": 64},
                "command": ["sh", "-c", f"[ -e {mark} ] && exit 0; touch {mark}; sleep 60"]}
        made = httpx.post(f"{api}/api/jobs", json=spec, params={"wait": 30}, timeout=40,
                          headers={"Authorization": f"Bearer {token}"})
        assert made.status_code == 201, made.text
        job_id = made.json()["job_id"]
        await wait_until(mark.exists, 30, "the first attempt to run")

        old = _children(data_dir)["local-0"]["pid"]
        os.kill(old, signal.SIGKILL)
        restarted = await wait_until(
            lambda: (c := _children(data_dir)["local-0"])["restarts"] == 1 and c, 30,
            "berth up to restart local-0")
        assert restarted["pid"] != old and _alive(restarted["pid"])
        assert restarted["last_exit"] == -signal.SIGKILL
        # The restarted agent serves its metrics on the same port again.
        scraped = await wait_until(lambda: _scrape(urls["local-0"]), 30, "local-0's metrics")
        assert 'berth_worker_attempts_running{worker="local-0"}' in scraped

        def ended() -> dict[str, Any] | None:
            job: dict[str, Any] = httpx.get(f"{api}/api/jobs/{job_id}", timeout=10).json()
            return job if job["state"] in ("succeeded", "failed") else None

        job = await wait_until(ended, 45, "the job to end")
        assert job["state"] == "succeeded"
        first, second = job["tasks"][0]["attempts"]
        assert first["state"] == "worker_failed" and first["worker_failure"] is True
        assert second["state"] == "succeeded" and second["worker_id"] == "local-0"
        # The new incarnation killed the first attempt's orphaned process group.
        left = await asyncio.to_thread(subprocess.run, ["pgrep", "-f", str(mark)],
                                       capture_output=True, text=True)
        assert left.stdout.strip() == ""

        # Still up, every child running; only local-0 was restarted, and that was said.
        assert up.returncode is None
        kids = _children(data_dir)
        assert all(_alive(c["pid"]) for c in kids.values())
        assert {label for label, c in kids.items() if c["restarts"]} == {"local-0"}
        said = (tmp_path / "up.err").read_text()
        assert f"local-0 (pid {old}) exited with code -9; restarting in" in said
        assert f"restarted local-0 (pid {restarted['pid']}, restart 1)" in said

        healthy = run_berth("--data-dir", str(data_dir), "health", timeout=60)
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        lines = {line.split()[0] if not line.startswith(("worker ", "berth up"))
                 else " ".join(line.split()[:2]): line for line in healthy.stdout.splitlines()}
        assert "leads, epoch" in lines["scheduler"] and " ok " in lines["scheduler"]
        assert "caught up" in lines["dashboard"]
        assert "last heartbeat" in lines["worker local-0"]
        assert "restarts: local-0 1" in lines["berth up"]

        pids = [old, up.pid, *(c["pid"] for c in kids.values())]
        up.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.wait(), 60) == 0
        assert [pid for pid in pids if _alive(pid)] == []
        assert not (data_dir / "stack.json").exists()

        down = run_berth("--data-dir", str(data_dir), "--api-url", api, "health",
                         "--redis-url", info["redis_url"], timeout=60)
        assert down.returncode == 1
        assert "dashboard          FAIL  no answer" in down.stdout
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(up.wait(), 30)
        if up.returncode is None:
            up.kill()
            await up.wait()
        err.close()


async def test_healthz_is_503_until_the_dashboard_has_caught_up(nc: NATS, tmp_path: Path
                                                                ) -> None:
    # A projection not yet started has folded nothing: it must not pass a readiness probe.
    projection = Projection(nc, worker_dead_after=3)
    app = create_app(projection, nc.jetstream(), auth.Tokens("", tmp_path / "tokens"))
    async with AsyncTestClient(app) as client:
        behind = await client.get("/healthz")
        assert behind.status_code == 503
        assert behind.json() == {"status": "catching_up", "events_seq": 0, "caught_up": False,
                                 "refused_events": 0, "last_refused_seq": 0}
        projection.caught_up.set()
        ready = await client.get("/healthz")
        assert ready.status_code == 200
        assert ready.json()["status"] == "ok" and ready.json()["caught_up"] is True


async def test_a_server_that_cannot_start_again_stops_the_stack(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    up = await asyncio.create_subprocess_exec(
        *BERTH, "--data-dir", str(data_dir), "up", "--workers", "0",
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await wait_until(lambda: "redis-server" in _children(data_dir), 60, "berth up")
        kids = _children(data_dir)
        # valkey's store turned into a file (before the kill, so no restart can win the
        # race): its config cannot be written, it cannot start.
        store = data_dir / "redis"
        shutil.rmtree(store)
        store.write_text("in the way\n")
        os.kill(kids["redis-server"]["pid"], signal.SIGKILL)
        _, err = await asyncio.wait_for(up.communicate(), 60)
        assert up.returncode == 1
        said = err.decode()
        assert "redis-server could not be started again:" in said and "; stopping" in said
        assert "Traceback" not in said
        assert [label for label, c in kids.items() if _alive(c["pid"])] == []
    finally:
        if up.returncode is None:
            up.kill()
            await up.wait()
