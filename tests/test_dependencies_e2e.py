"""Dependencies, master-done and retry backoff through the real services, with real worker
processes: one stack, the scenarios side by side to keep within the test budget."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from berth import cli
from berth.client import submit_job
from berth.shared.messages import Backoff, JobSpec, Resources, RetryEvent, RetryPolicy, StopCriteria
from berth.stack import Stack
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


# Each start appends its time to $DIR/starts-<attempt>; attempt 0 waits for $DIR/go, then
# fails; later attempts succeed.
FAIL_FIRST = """
import os, pathlib, sys, time
d = pathlib.Path(os.environ['DIR']); a = os.environ['BERTH_ATTEMPT_ID']
with open(d / f'starts-{a}', 'a') as f:
    f.write(f'{time.time()}\\n')
if a == '0':
    while not (d / 'go').exists():
        time.sleep(0.05)
    sys.exit(1)
"""
BACKOFF = 6.0


def job(directory: Path, name: str, code: int = 0, **spec: Any) -> JobSpec:
    directory.mkdir()
    return JobSpec(name=name, command=["python3", "-c", SCRIPT], resources=SMALL,
                   env={"DIR": str(directory), "CODE": str(code), **spec.pop("env", {})},
                   **spec)


async def test_dependencies_master_done_and_a_retry_backoff_across_a_failover(
        make_stack, nc: NATS, tmp_path: Path, capsys) -> None:
    stack: Stack = make_stack(workers=1)
    stack.start_service("scheduler", label="scheduler-2")  # the standby
    await wait_until(lambda: get_json(stack, "/api/workers"), what="the worker")

    a = await accepted(nc, job(tmp_path / "a", "a"))
    b = await accepted(nc, job(tmp_path / "b", "b", after=[a]))
    bad = await accepted(nc, job(tmp_path / "bad", "bad", code=1))
    dependent = await accepted(nc, job(tmp_path / "dep", "dep", after=[bad]))
    master = await accepted(nc, job(tmp_path / "m", "m", replicas=3,
                                    stop_criteria=StopCriteria.MASTER_DONE))
    retried = await accepted(nc, JobSpec(
        name="retried", command=["python3", "-c", FAIL_FIRST], resources=SMALL,
        env={"DIR": str(tmp_path)}, max_retries_failure=1,
        retry=RetryPolicy(on_events=[RetryEvent.ERROR], backoff=Backoff(initial=BACKOFF))))
    # Never placeable (no worker has 64 cpu): each 1 s scheduling timeout is a retry until
    # 2 s after the first, then it is unschedulable.
    no_room = await accepted(nc, JobSpec(
        name="no-room", command=["true"], resources=Resources(cpu=64), scheduling_timeout=1,
        retry=RetryPolicy(on_events=[RetryEvent.NO_CAPACITY], duration=2,
                          backoff=Backoff(initial=0.5))))
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

    # The retried job's first attempt fails: it waits out its backoff, pending.
    (tmp_path / "go").touch()
    backing_off = await wait_until(
        lambda: (t := job_now(stack, retried)["tasks"][0])["retry_at"] and t, what="a backoff")
    assert backing_off["state"] == "pending" and backing_off["retries"] == 1
    assert backing_off["pending_reason"].startswith("retrying in ")
    assert backing_off["pending_reason"].endswith("s (attempt 2, backoff)")
    failed_at = backing_off["attempts"][0]["finished_at"]
    assert backing_off["retry_at"] == failed_at + BACKOFF

    # The leader goes, in the middle of that wait; the standby, folding the same log, knows
    # b still waits for a, and when the retry may start.
    assert time.time() < backing_off["retry_at"] - 1
    await asyncio.to_thread(stack.stop_child, "scheduler")
    standby_log = stack.data_dir / "logs" / "scheduler-2.log"
    await wait_until(lambda: "leading with epoch" in standby_log.read_text(),
                     what="the standby to lead")
    assert job_now(stack, b)["waiting_for"] == a
    assert not (tmp_path / "b" / "0.pid").exists()
    # Whenever the new leader placed the retry, it was not before its time.
    after = job_now(stack, retried)["tasks"][0]["attempts"]
    assert all(x["assigned_at"] >= backing_off["retry_at"] for x in after[1:])

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

    # The retry started by the new leader, not before its backoff was over, each attempt
    # once and only after the one before it had ended. (One that the worker fenced while
    # the take-over went on ended worker_failed and was retried at once: the policy does
    # not name interruption.)
    done = await wait_for_job(stack, retried, {"succeeded"})
    attempts = done["tasks"][0]["attempts"]
    assert attempts[0]["state"] == "failed" and attempts[-1]["state"] == "succeeded"
    assert all(x["worker_failure"] for x in attempts[1:-1]), attempts
    for before, later in itertools.pairwise(attempts):
        assert later["assigned_at"] >= max(before["finished_at"], backing_off["retry_at"])
    for x in attempts[1:]:  # a fenced one may have been stopped before its process began
        path = tmp_path / f"starts-{x['attempt_id']}"
        starts = path.read_text().split() if path.exists() else []
        assert len(starts) <= 1 and all(float(t) >= backing_off["retry_at"] for t in starts)
    assert (tmp_path / f"starts-{attempts[-1]['attempt_id']}").exists()
    gave_up = await wait_for_job(stack, no_room, {"unschedulable"})
    assert gave_up["tasks"][0]["retries"] >= 1
    assert gave_up["tasks"][0]["attempts"] == []
    assert "scheduling timeout of 1s expired" in gave_up["tasks"][0]["error"]

    ended = await wait_for_job(stack, master, {"succeeded"})
    assert [t["state"] for t in ended["tasks"]] == ["succeeded", "killed", "killed"]
    for i in (1, 2):
        pid = int((tmp_path / "m" / f"{i}.pid").read_text())
        await wait_until(lambda p=pid: not alive(p), what=f"master-done task {i} gone")
