"""GPUs pinned per task, end to end on the real stack (issue 20): a worker offering
`--gpu h100:2` on a host without NVML (devices 0 and 1, unchecked). Two one-GPU tasks
running at once see different CUDA_VISIBLE_DEVICES, a third waits with a pending reason
naming the GPUs, a task that asked for no GPU sees "", and the doctor finds no device held
twice. A device an operator takes out of service gets no new attempt. Quotas and tokens
run beside it on the same stack (tests/limits_scenario.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
from nats.aio.client import Client as NATS

from berth.shared.messages import GpuDevice, JobSpec, Resources
from berth.stack import Stack
from tests import limits_scenario
from tests.conftest import get_json, run_doctor, wait_for_job, wait_until
from tests.test_lifecycle_e2e import accepted

# Records what the task sees, then holds its GPU until the test lets it go.
SEE_AND_HOLD = """
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
name = os.environ["BERTH_JOB_ID"] + "-" + os.environ["BERTH_TASK_INDEX"]
(out / (name + ".seen")).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
while not (out / "go").exists():
    time.sleep(0.05)
"""

ONE_GPU = Resources(cpu=0.5, memory_mb=64, device=GpuDevice(variant="h100", count=1))


def seen(out: Path) -> dict[str, str]:
    return {p.stem: p.read_text() for p in out.glob("*.seen")}


async def berth(stack: Stack, *args: str) -> str:
    """A `berth` command beside the stack, as a user (or operator) runs it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "berth.cli", "--data-dir", str(stack.data_dir), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def tasks_of(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = get_json(stack, f"/api/jobs/{job_id}")["tasks"]
    return tasks


def pending_reason(stack: Stack, job_id: str) -> str:
    """The job's first task's pending reason; "" while the dashboard has not yet folded the
    job (its view follows the events stream, so it may lag the submit's outcome a little)."""
    resp = httpx.get(f"{stack.api_url}/api/jobs/{job_id}", timeout=10)
    if resp.status_code == 404:
        return ""
    resp.raise_for_status()
    return str(resp.json()["tasks"][0]["pending_reason"])


async def test_one_gpu_tasks_get_distinct_devices_and_a_no_gpu_task_none(
        make_stack, nc: NATS, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=0, extra_env={"BERTH_PENDING_REASON_INTERVAL": "0.2"})
    stack.start_worker("gpu0", 4, 2048, "--gpu", "h100:2")
    out = tmp_path / "seen"
    out.mkdir()
    hold = [sys.executable, "-c", SEE_AND_HOLD, str(out)]
    limited = await limits_scenario.start(stack, nc, tmp_path / "limits")
    pair = await accepted(nc, JobSpec(name="pair", command=hold, replicas=2,
                                      resources=ONE_GPU))
    await wait_until(lambda: len(seen(out)) == 2, 30, "both one-GPU tasks to start")
    third = await accepted(nc, JobSpec(name="third", command=hold, resources=ONE_GPU))
    reason = await wait_until(lambda: pending_reason(stack, third), 30,
                              "the third task's pending reason")
    assert "h100 GPUs" in reason and "need 1, largest free 0" in reason, reason
    plain = await accepted(nc, JobSpec(name="plain", command=hold,
                                       resources=Resources(cpu=0.5, memory_mb=64)))
    await wait_until(lambda: f"{plain}-0" in seen(out), 30, "the no-GPU task to start")

    views = seen(out)
    assert {views[f"{pair}-0"], views[f"{pair}-1"]} == {"0", "1"}  # one device each
    assert views[f"{plain}-0"] == ""  # asked for no GPU: sees none
    assert f"{third}-0" not in views  # still waiting for a GPU
    # Recorded on the attempts, and on the worker's device list.
    held = {tuple(t["attempts"][0]["devices"]) for t in tasks_of(stack, pair)}
    assert held == {(0,), (1,)}
    (worker,) = get_json(stack, "/api/workers")
    assert sorted(d["held_by"] for d in worker["devices"]) == [f"{pair}/0/0", f"{pair}/1/0"]
    await limits_scenario.waiting(stack, limited)
    doctor = (await run_doctor(stack)).splitlines()
    for line in ("double_booked_devices=0", "violations=0", *limits_scenario.DOCTOR_ZEROS):
        assert line in doctor, doctor
    limits_scenario.release(limited)
    listing = await berth(stack, "workers")
    assert "device 0: unchecked  held by" in listing, listing

    (out / "go").write_text("")
    for job_id in (pair, plain, third):
        job = await wait_for_job(stack, job_id, {"succeeded", "failed"}, timeout=30)
        assert job["state"] == "succeeded", job
    assert seen(out)[f"{third}-0"] in {"0", "1"}  # placed once a device was free

    # An operator takes device 0 out of service: the next one-GPU task gets device 1.
    assert "takes no new attempts" in await berth(stack, "device", "disable", "gpu0", "0")
    await wait_until(lambda: get_json(stack, "/api/workers")[0]["devices"][0]["unhealthy"],
                     30, "device 0 to be out of service")
    after = await accepted(nc, JobSpec(name="after", command=hold, resources=ONE_GPU))
    assert (await wait_for_job(stack, after, {"succeeded", "failed"}))["state"] == "succeeded"
    assert seen(out)[f"{after}-0"] == "1"
    assert "returned to service" in await berth(stack, "device", "enable", "gpu0", "0")
    await limits_scenario.finish(stack, limited)
