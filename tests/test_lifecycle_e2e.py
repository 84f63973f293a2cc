"""The seed's task lifecycle through the real services: retries, worker death, cancellation,
parent/child cascades and timeouts, with real processes whose end the tests verify."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
from nats.aio.client import Client as NATS

from berth import cli
from berth.client import cancel_job, publish_submit, submit_job, wait_for_outcome
from berth.shared import subjects
from berth.shared.messages import JobSpec, Resources
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until

SMALL = Resources(cpu=0.5, memory_mb=64)

# Writes "<pid> <grandchild pid>" to $PID_FILE, then runs until killed. With IGNORE_TERM set
# it ignores SIGTERM, so only the SIGKILL after the grace period ends it. Attempts listed in
# $FINISH_ATTEMPTS exit 0 at once instead.
RUN_UNTIL_KILLED = """
import os, pathlib, signal, subprocess, sys, time
if os.environ['BERTH_ATTEMPT_ID'] in os.environ.get('FINISH_ATTEMPTS', '').split(','):
    sys.exit(0)
if os.environ.get('IGNORE_TERM'):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
kid = subprocess.Popen(['sleep', '300'])
path = pathlib.Path(os.environ['PID_FILE'])
path.with_suffix('.tmp').write_text(f'{os.getpid()} {kid.pid}')
path.with_suffix('.tmp').rename(path)
time.sleep(300)
"""


def long_task(pid_file: Path, name: str = "long", **spec: Any) -> JobSpec:
    env = {"PID_FILE": str(pid_file), **spec.pop("env", {})}
    return JobSpec(name=name, command=["python3", "-c", RUN_UNTIL_KILLED], env=env,
                   resources=spec.pop("resources", SMALL), **spec)


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (PID 1 here may never reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def pids_of(pid_file: Path) -> tuple[int, int]:
    text = await wait_until(lambda: pid_file.exists() and pid_file.read_text(),
                            what=f"{pid_file.name} written")
    task_pid, grandchild_pid = (int(p) for p in text.split())
    return task_pid, grandchild_pid


async def accepted(nc: NATS, spec: JobSpec) -> str:
    outcome = await submit_job(nc, spec)
    assert outcome.accepted, outcome.reason
    return str(outcome.job_id)


def task(job: dict[str, Any], index: int = 0) -> dict[str, Any]:
    result: dict[str, Any] = job["tasks"][index]
    return result


def job_now(stack: Stack, job_id: str) -> dict[str, Any]:
    result: dict[str, Any] = get_json(stack, f"/api/jobs/{job_id}")
    return result


def assert_attempt_history_complete(job: dict[str, Any]) -> None:
    """What the issue asks the job detail to show for every attempt."""
    for t in job["tasks"]:
        ids = [a["attempt_id"] for a in t["attempts"]]
        assert ids == sorted(set(ids)), ids
        for a in t["attempts"]:
            assert a["worker_id"] and a["state"] and a["assigned_at"] > 0
            assert {"exit_code", "error", "started_at", "finished_at", "worker_failure"} <= set(a)


async def test_fails_twice_then_succeeds_under_max_retries_failure_2(make_stack, nc) -> None:
    stack: Stack = make_stack(workers=1)
    flaky = JobSpec(
        name="flaky", max_retries_failure=2, resources=SMALL,
        command=["python3", "-c",
                 "import os, sys; sys.exit(0 if int(os.environ['BERTH_ATTEMPT_ID']) >= 2 else 7)"],
    )
    doomed = JobSpec(name="doomed", max_retries_failure=1, resources=SMALL,
                     command=["python3", "-c", "import sys; sys.exit(5)"])
    flaky_id, doomed_id = await accepted(nc, flaky), await accepted(nc, doomed)

    job = await wait_for_job(stack, flaky_id, {"succeeded", "failed"})
    assert job["state"] == "succeeded"
    t = task(job)
    assert [(a["attempt_id"], a["state"], a["exit_code"]) for a in t["attempts"]] == [
        (0, "failed", 7), (1, "failed", 7), (2, "succeeded", 0)]
    assert t["failure_count"] == 2 and t["preemption_count"] == 0
    assert all(a["started_at"] and a["finished_at"] for a in t["attempts"])
    assert_attempt_history_complete(job)

    # counter > limit is terminal: one retry allowed, so two attempts, then FAILED.
    job = await wait_for_job(stack, doomed_id, {"succeeded", "failed"})
    assert job["state"] == "failed"
    t = task(job)
    assert [a["state"] for a in t["attempts"]] == ["failed", "failed"]
    assert t["failure_count"] == 2 and t["exit_code"] == 5
    assert "exited with code 5" in job["error"]


async def first_attempt_running_on_one_of_two(make_stack: Any, nc: NATS, tmp_path: Path
                                              ) -> tuple[Stack, str, str, int, int]:
    """Two workers, a job whose first attempt runs until killed and whose retries succeed:
    (stack, job id, the first attempt's worker, its task pid, its grandchild pid)."""
    stack: Stack = make_stack(workers=2)
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2, what="2 workers")
    pid_file = tmp_path / "pids"
    job_id = await accepted(nc, long_task(pid_file, env={"FINISH_ATTEMPTS": "1,2,3"}))
    task_pid, grandchild = await pids_of(pid_file)
    victim = task(job_now(stack, job_id))["attempts"][0]["worker_id"]
    return stack, job_id, victim, task_pid, grandchild


async def test_sigkilled_worker_fails_over_and_its_whole_task_tree_dies_with_it(
        make_stack, nc, tmp_path: Path) -> None:
    stack, job_id, victim, task_pid, grandchild = await first_attempt_running_on_one_of_two(
        make_stack, nc, tmp_path)
    incarnation = next(w["incarnation"] for w in get_json(stack, "/api/workers")
                       if w["worker_id"] == victim)

    stack.children.pop(victim).send_signal(signal.SIGKILL)
    # The task's supervisor sees its agent gone and kills the whole tree at once, the
    # grandchild too: nothing of the attempt runs while it is retried elsewhere.
    await wait_until(lambda: not alive(task_pid) and not alive(grandchild), 5,
                     what="the task's whole tree to die with its agent")
    job = await wait_for_job(stack, job_id, {"succeeded", "failed", "killed"}, timeout=40)
    assert job["state"] == "succeeded"
    t = task(job)
    assert [a["state"] for a in t["attempts"]] == ["worker_failed", "succeeded"]
    assert t["attempts"][0]["worker_failure"] and t["attempts"][0]["error"] == "worker dead"
    assert t["attempts"][1]["worker_id"] != victim
    assert t["preemption_count"] == 1 and t["failure_count"] == 0
    assert_attempt_history_complete(job)
    stack.start_worker(victim)

    def back() -> bool:
        w = next((w for w in get_json(stack, "/api/workers") if w["worker_id"] == victim), None)
        return bool(w and w["healthy"] and w["incarnation"] != incarnation)

    await wait_until(back, what="the worker back as a new incarnation")
    again = job_now(stack, job_id)  # the old attempt stays written off
    assert [a["state"] for a in task(again)["attempts"]] == ["worker_failed", "succeeded"]


async def test_a_paused_workers_tasks_are_gone_before_their_retry_is_placed(
        make_stack, nc, tmp_path: Path) -> None:
    """The agent is paused past the dead-after time: it cannot kill anything itself, but its
    tasks' supervisors stop hearing that the leader acknowledged its heartbeats, and kill
    the whole tree at the fence deadline, before the leader may declare the worker dead."""
    stack, job_id, victim, task_pid, grandchild = await first_attempt_running_on_one_of_two(
        make_stack, nc, tmp_path)
    agent = stack.children[victim]
    gone_at: list[float] = []

    async def watch() -> None:
        await wait_until(lambda: not alive(task_pid) and not alive(grandchild), 60,
                         "the first attempt's processes to end")
        gone_at.append(time.time())

    watching = asyncio.create_task(watch())
    agent.send_signal(signal.SIGSTOP)
    try:
        job = await wait_for_job(stack, job_id, {"succeeded", "failed", "killed"}, timeout=40)
    finally:
        agent.send_signal(signal.SIGCONT)
    await asyncio.wait_for(watching, 1)
    assert job["state"] == "succeeded"
    retry = task(job)["attempts"][1]
    assert gone_at[0] < retry["assigned_at"], "the first attempt ran beside its retry"

    def reregistered() -> bool:
        w = next(w for w in get_json(stack, "/api/workers") if w["worker_id"] == victim)
        return bool(w["healthy"])

    await wait_until(reregistered, what="the reset worker to be healthy again")
    t = task(job_now(stack, job_id))
    assert [a["state"] for a in t["attempts"]] == ["worker_failed", "succeeded"]
    assert t["state"] == "succeeded"


async def test_cancel_mid_run_kills_the_processes(make_stack, nc, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=1)
    stubborn_pids, polite_pids = tmp_path / "stubborn", tmp_path / "polite"
    stubborn = await accepted(nc, long_task(stubborn_pids, "stubborn", env={"IGNORE_TERM": "1"}))
    polite = await accepted(nc, long_task(polite_pids, "polite"))
    stubborn_pid, stubborn_kid = await pids_of(stubborn_pids)
    polite_pid, polite_kid = await pids_of(polite_pids)

    # Any language: a JSON message on berth.submit.cancel.
    payload = json.dumps({"job_id": stubborn, "reason": "wrong data", "user": "ada"}).encode()
    outcome = await wait_for_outcome(nc, await publish_submit(nc, payload,
                                                              subject=subjects.SUBMIT_CANCEL))
    assert outcome.accepted and outcome.job_id == stubborn
    # The dashboard API.
    auth = {"Authorization": f"Bearer {stack.api_token}"}
    resp = httpx.post(f"{stack.api_url}/api/jobs/{polite}/cancel", json={"reason": "done"},
                      headers=auth)
    assert resp.status_code == 202, resp.text
    # 202 is the cancel stored, not yet decided: its outcome is folded a moment later.
    outcome = f"{stack.api_url}/api/submits/{resp.json()['submit_seq']}"
    decided = await wait_until(lambda: (r := httpx.get(outcome, timeout=10)).status_code == 200
                               and r.json(), what="the cancel's outcome")
    assert decided["kind"] == "cancel"

    job = await wait_for_job(stack, polite, {"killed"})
    # The API's cancel carries the token's identity (BERTH_API_TOKEN's is `admin`).
    assert job["error"] == "cancelled by admin: done"
    assert task(job)["state"] == "killed"
    attempt = await wait_until(
        lambda: task(job_now(stack, polite))["attempts"][0]["exited"]
        and task(job_now(stack, polite))["attempts"][0], what="the kill confirmed")
    assert attempt["state"] == "killed" and attempt["exit_code"] == -signal.SIGTERM
    assert not alive(polite_pid) and not alive(polite_kid)

    job = await wait_for_job(stack, stubborn, {"killed"})
    assert job["error"] == "cancelled by ada: wrong data"
    # It ignores SIGTERM: only the SIGKILL after the grace period (2 s here) ends it.
    attempt = await wait_until(
        lambda: task(job_now(stack, stubborn))["attempts"][0]["exited"]
        and task(job_now(stack, stubborn))["attempts"][0], what="the SIGKILL")
    assert attempt["state"] == "killed" and attempt["exit_code"] == -signal.SIGKILL
    assert not alive(stubborn_pid) and not alive(stubborn_kid)
    assert_attempt_history_complete(job)
    # Resources come back once the worker confirmed both exits.
    await wait_until(lambda: get_json(stack, "/api/workers")[0]["cpu_free"] == 2.0,
                     what="capacity released")

    # Cancelling again: the API says it already ended; an unknown job is a clear rejection.
    again = httpx.post(f"{stack.api_url}/api/jobs/{polite}/cancel", headers=auth)
    assert again.status_code == 409 and "already killed" in again.json()["detail"]
    assert httpx.post(f"{stack.api_url}/api/jobs/j999-abcd/cancel",
                      headers=auth).status_code == 404
    bad = httpx.post(f"{stack.api_url}/api/jobs/{polite}/cancel", json={"reason": 3},
                     headers=auth)
    assert bad.status_code == 400 and "reason" in bad.text
    unknown = await cancel_job(nc, "j999-abcd")
    assert not unknown.accepted and unknown.reason == "job_id: no job 'j999-abcd'"
    malformed = await wait_for_outcome(nc, await publish_submit(
        nc, b'{"job": "x"}', subject=subjects.SUBMIT_CANCEL))
    assert not malformed.accepted and "invalid cancel request" in str(malformed.reason)


async def test_cancelling_a_parent_cancels_its_descendants(make_stack, nc, tmp_path: Path
                                                           ) -> None:
    stack: Stack = make_stack(workers=1)
    parent = await accepted(nc, long_task(tmp_path / "p", "parent"))
    child = await accepted(nc, long_task(tmp_path / "c", "child", parent=parent))
    grandchild = await accepted(nc, long_task(tmp_path / "g", "grandchild", parent=child))
    pids = [await pids_of(tmp_path / name) for name in ("p", "c", "g")]
    assert job_now(stack, parent)["children"] == [child]
    assert job_now(stack, grandchild)["parent"] == child

    orphan = await submit_job(nc, long_task(tmp_path / "x", "orphan", parent="j999-abcd"))
    assert not orphan.accepted and orphan.reason == "parent: no job 'j999-abcd'"

    assert (await cancel_job(nc, parent)).accepted
    for job_id, why in ((parent, "cancelled"), (child, f"parent job {parent} killed"),
                        (grandchild, f"parent job {child} killed")):
        job = await wait_for_job(stack, job_id, {"killed"})
        assert job["error"] == why, job
    for task_pid, kid in pids:
        await wait_until(lambda p=task_pid, k=kid: not alive(p) and not alive(k),
                         what="every process of the family gone")

    # A child submitted to a parent that already ended (not succeeded) is cancelled at once.
    late = await accepted(nc, long_task(tmp_path / "l", "late", parent=parent))
    job = await wait_for_job(stack, late, {"killed"})
    assert job["error"] == f"parent job {parent} is killed"
    assert task(job)["attempts"] == []


async def test_scheduling_timeout_makes_the_job_unschedulable(make_stack, nc, tmp_path: Path,
                                                              capsys) -> None:
    stack: Stack = make_stack(workers=1)
    await wait_until(lambda: get_json(stack, "/api/workers"), what="the worker")
    # Two 1.5-core tasks on one 2-core worker: task 0 runs, task 1 cannot be placed.
    spec = long_task(tmp_path / "pids", "wide", replicas=2, scheduling_timeout=3,
                     resources=Resources(cpu=1.5, memory_mb=64))
    job_id = await accepted(nc, spec)
    task_pid, kid = await pids_of(tmp_path / "pids")
    reason = "insufficient cpu: need 1.5 cores, largest free 0.5 cores on 1 worker"
    waiting = await wait_until(lambda: task(job_now(stack, job_id), 1)["pending_reason"],
                               what="a pending reason")
    assert waiting == reason
    assert cli.main(["--api-url", stack.api_url, "status", job_id]) == 0
    assert f"task 1: pending  (waiting: {reason})" in capsys.readouterr().out

    job = await wait_for_job(stack, job_id, {"unschedulable", "killed", "failed"})
    assert job["state"] == "unschedulable"
    t1 = task(job, 1)
    assert t1["state"] == "unschedulable" and t1["attempts"] == []
    assert t1["error"] == f"scheduling timeout of 3s expired: {reason}"
    assert task(job, 0)["state"] == "killed" and task(job, 0)["error"] == "job unschedulable"
    await wait_until(lambda: not alive(task_pid) and not alive(kid),
                     what="the placed task killed")


async def test_task_runtime_timeout_kills_it_with_a_reason(make_stack, nc, tmp_path: Path
                                                           ) -> None:
    stack: Stack = make_stack(workers=1)
    job_id = await accepted(nc, long_task(tmp_path / "pids", "slow", timeout=1.0))
    task_pid, kid = await pids_of(tmp_path / "pids")
    job = await wait_for_job(stack, job_id, {"killed", "failed", "succeeded"})
    assert job["state"] == "killed"
    t = task(job)
    assert t["state"] == "killed"
    assert t["error"] == "timed out: ran longer than the task timeout of 1s"
    assert t["attempts"][0]["exit_code"] == -signal.SIGTERM
    assert "timed out" in job["error"]
    assert not alive(task_pid) and not alive(kid)
