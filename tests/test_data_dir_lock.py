"""One stack per data dir (issue 21 item 5): `berth up` and the services that keep state in
the data dir hold an exclusive flock on it; a second one is refused, naming the holder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from berth.shared import dir_lock
from berth.stack import Stack
from tests.conftest import wait_until


def test_a_lock_is_exclusive_names_its_holder_and_is_free_once_released(
        tmp_path: Path) -> None:
    lock = dir_lock.acquire(tmp_path / "stack.lock", "berth up")
    with pytest.raises(dir_lock.DirLocked) as refused:
        dir_lock.acquire(tmp_path / "stack.lock", "berth up")
    assert f"held by berth up (pid {os.getpid()})" in str(refused.value)
    assert "\n" not in str(refused.value)
    lock.release()
    dir_lock.acquire(tmp_path / "stack.lock", "berth up").release()


def test_a_lock_of_a_killed_process_is_free(tmp_path: Path) -> None:
    """The kernel drops a dead process's flock: a crash leaves nothing to clean up."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from berth.shared import dir_lock; "
        f"dir_lock.acquire(Path({str(tmp_path / 'w.lock')!r}), 'worker w'); "
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    with pytest.raises(dir_lock.DirLocked, match=f"worker w \\(pid {holder.pid}\\)"):
        dir_lock.acquire(tmp_path / "w.lock", "worker w")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    dir_lock.acquire(tmp_path / "w.lock", "worker w").release()


def test_a_second_worker_with_the_same_id_on_one_data_dir_is_refused(make_stack: Any) -> None:
    stack: Stack = make_stack(workers=1)
    dup = stack.start_service("worker", "--id", "local-0", "--cpu", "1", "--memory-mb", "256",
                              label="duplicate", scope="local-0")
    assert dup.wait(30) == 1
    stack.children.pop("duplicate")
    log = (stack.data_dir / "logs" / "duplicate.log").read_text().strip()
    assert log.startswith("berth worker: ") and "worker local-0 (pid " in log, log
    assert len(log.splitlines()) == 1, log
    assert stack.children["local-0"].poll() is None


def _berth(data_dir: Path, *args: str, **kw: Any) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    return subprocess.Popen([sys.executable, "-m", "berth.cli", "--data-dir", str(data_dir),
                             *args], env=env, stdin=subprocess.DEVNULL, **kw)


async def test_a_second_berth_up_on_one_data_dir_is_refused_and_the_first_runs_on(
        tmp_path: Path) -> None:
    data_dir = tmp_path / "berth"
    first = _berth(data_dir, "up", "--workers", "1", stderr=subprocess.DEVNULL)
    try:
        info = await wait_until(
            lambda: (data_dir / "stack.json").exists()
            and json.loads((data_dir / "stack.json").read_text()), 60, "berth up to start")
        api, token = info["api_url"], (data_dir / "api-token").read_text().strip()
        job = {"name": "keeps-running", "command": ["sleep", "6"],
               "resources": {"cpu": 0.1, "memory_mb": 16}}
        created = httpx.post(f"{api}/api/jobs", json=job, timeout=30,
                             headers={"Authorization": f"Bearer {token}"})
        assert created.status_code == 201, created.text
        job_id = created.json()["job_id"]

        def state() -> str:
            return str(httpx.get(f"{api}/api/jobs/{job_id}", timeout=10).json()["state"])

        await wait_until(lambda: state() == "running", 30, "the job to run")

        second = _berth(data_dir, "up", "--workers", "1", stderr=subprocess.PIPE)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 1
        refusal = err.decode().strip().splitlines()[-1]
        assert refusal.startswith("berth: ") and f"berth up (pid {first.pid})" in refusal, err
        assert "Traceback" not in err.decode()

        # Nothing of the first stack was touched: its task runs on and succeeds.
        assert state() == "running" and first.poll() is None
        assert (data_dir / "stack.json").exists()
        await wait_until(lambda: state() == "succeeded", 30, "the job to succeed")
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # every child gone: the lock is free again
        try:
            dir_lock.acquire(data_dir / "stack.lock", "test").release()
            break
        except dir_lock.DirLocked:
            time.sleep(0.2)
    else:
        pytest.fail("the stack's lock outlived its processes")
