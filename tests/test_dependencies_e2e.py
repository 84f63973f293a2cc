"""Dependencies and master-done through the real services, with real worker processes: one
stack, the three scenarios side by side to keep within the test budget."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from berth import cli
from berth.client import submit_job
from berth.stack import Stack
from shared.messages import JobSpec, Resources, StopCriteria
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_lifecycle_e2e import accepted, alive, job_now

SMALL = Resources(cpu=0.25, memory_mb=64)

# Task $BERTH_TASK_INDEX writes its pid to $DIR/<index>.pid; the tasks listed in $FINISH
# wait for $DIR/go, then exit with $CODE; the others run until killed.
SCRIPT = """
import os, pathlib, sys, time
d = pathlib.Path(os.environ['DIR']); i = os.environ['BERTH_TASK_INDEX']
(d / f'{i}.pid').write_text(str(os.getpid()))
if i in os.environ.get('FINISH', '0').split(','):
    while not (d / 'go').exists():
        time.sleep(0.05)
    sys.exit(int(os.environ.get('CODE', '0')))
time.sleep(300)
"""


def job(directory: Path, name: str, code: int = 0, **spec: Any) -> JobSpec:
    directory.mkdir()
    return JobSpec(name=name, command=["python3", "-c", SCRIPT], resources=SMALL,
                   env={"DIR": str(directory), "CODE": str(code), **spec.pop("env", {})},
                   **spec)


async def test_chains_failing_dependencies_and_master_done(make_stack, nc: NATS,
                                                           tmp_path: Path, capsys) -> None:
    stack: Stack = make_stack(workers=1)
    stack.start_service("scheduler", label="scheduler-2")  # the standby
    await wait_until(lambda: get_json(stack, "/api/workers"), what="the worker")

    a = await accepted(nc, job(tmp_path / "a", "a"))
    b = await accepted(nc, job(tmp_path / "b", "b", after=[a]))
    bad = await accepted(nc, job(tmp_path / "bad", "bad", code=1))
    dependent = await accepted(nc, job(tmp_path / "dep", "dep", after=[bad]))
    master = await accepted(nc, job(tmp_path / "m", "m", replicas=3,
                                    stop_criteria=StopCriteria.MASTER_DONE))
    unknown = await submit_job(nc, job(tmp_path / "u", "u", after_any=[a, "j999-abcd"]))
    assert not unknown.accepted and unknown.reason == "after_any[1]: no job 'j999-abcd'"
    # A user may depend only on their own jobs: another's is no job of theirs.
    foreign = await submit_job(nc, job(tmp_path / "f", "f", after=[a]), user="ada")
    assert not foreign.accepted and foreign.reason == f"after[0]: no job '{a}' of 'ada'"

    # a runs; b waits, unplaced, saying why.
    await wait_until(lambda: (tmp_path / "a" / "0.pid").exists(), what="a running")
    await wait_until(lambda: all((tmp_path / "m" / f"{i}.pid").exists() for i in range(3)),
                     what="the master-done job's 3 tasks running")
    waiting = job_now(stack, b)
    assert waiting["state"] == "pending" and waiting["waiting_for"] == a
    assert waiting["tasks"][0]["pending_reason"] == f"waiting for {a}"
    assert waiting["tasks"][0]["attempts"] == []
    assert not (tmp_path / "b" / "0.pid").exists()

    # The leader goes; the standby, folding the same log, knows b still waits for a.
    await asyncio.to_thread(stack.stop_child, "scheduler")
    standby_log = stack.data_dir / "logs" / "scheduler-2.log"
    await wait_until(lambda: "leading with epoch" in standby_log.read_text(),
                     what="the standby to lead")
    assert job_now(stack, b)["waiting_for"] == a
    assert not (tmp_path / "b" / "0.pid").exists()

    for name in ("a", "bad", "m"):
        (tmp_path / name / "go").touch()

    done_a = await wait_for_job(stack, a, {"succeeded"})
    (tmp_path / "b" / "go").touch()
    done_b = await wait_for_job(stack, b, {"succeeded"})
    assert done_b["started_at"] >= done_a["finished_at"]
    assert len(done_b["tasks"][0]["attempts"]) == 1  # started once, by the new leader

    killed = await wait_for_job(stack, dependent, {"killed"})
    assert killed["failure_reason"] == "DEPENDENCY"
    assert killed["error"] == f"dependency {bad} is failed"
    assert killed["tasks"][0]["attempts"] == []
    assert cli.main(["--api-url", stack.api_url, "status", dependent]) == 0
    assert "failure_reason: DEPENDENCY" in capsys.readouterr().out

    ended = await wait_for_job(stack, master, {"succeeded"})
    assert [t["state"] for t in ended["tasks"]] == ["succeeded", "killed", "killed"]
    for i in (1, 2):
        pid = int((tmp_path / "m" / f"{i}.pid").read_text())
        await wait_until(lambda p=pid: not alive(p), what=f"master-done task {i} gone")
