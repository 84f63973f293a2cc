"""Node health and resource use on the real stack (docs/operations.md, "Node health"): a
task's CPU time and peak memory reported with its exit; a drained worker takes nothing new
and what still runs there at the deadline is preempted and runs elsewhere; a host whose
attempts keep failing for non-user causes is quarantined, never chosen, and released by an
operator. One stack for all of it (each new one costs CI seconds)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
from typing import Any

from nats.aio.client import Client as NATS

from berth import cli
from berth.client import cancel_job, submit_job
from berth.shared.messages import Constraint, ConstraintMode, JobSpec, Op, Resources
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_gpu_pinning import berth

SMALL = Resources(cpu=0.5, memory_mb=64)
# 80 MiB held by the task and 40 by its child at once; half a second of CPU burnt.
HUNGRY = ("import subprocess, time\n"
          "x = bytearray(80 * 2**20)\n"
          "t = time.process_time()\n"
          "while time.process_time() - t < 0.5: pass\n"
          "subprocess.run(['python3', '-c', 'y = bytearray(40 * 2**20); "
          "import time; time.sleep(1.5)'])\n")


async def in_cli(stack: Stack, *args: str) -> str:
    """The `berth` command's own code, run in this process (no interpreter start)."""
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return cli.main(["--data-dir", str(stack.data_dir), *args])

    assert await asyncio.to_thread(run) == 0
    return out.getvalue()


def worker(stack: Stack, worker_id: str) -> dict[str, Any]:
    found: dict[str, Any] = get_json(stack, f"/api/workers/{worker_id}")
    return found


def workers_of(job: dict[str, Any]) -> list[str]:
    return [a["worker_id"] for t in job["tasks"] for a in t["attempts"]]


async def test_peaks_drain_and_quarantine(make_stack, nc: NATS) -> None:
    stack: Stack = make_stack(workers=2, extra_env={
        "BERTH_QUARANTINE_FAILURES": "2", "BERTH_QUARANTINE_JOBS": "2"})
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2, what="2 workers")

    # A task's peaks, and a preferred constraint no worker satisfies: placed all the same.
    spec = JobSpec(name="hungry", command=["python3", "-c", HUNGRY], resources=SMALL,
                   constraints=[Constraint(key="zone", op=Op.EQ, value="eu",
                                           mode=ConstraintMode.PREFERRED)])
    hungry = str((await submit_job(nc, spec)).job_id)
    sleeper = str((await submit_job(nc, JobSpec(
        name="sleeper", replicas=2, command=["sleep", "60"], resources=SMALL,
        max_retries_preemption=2))).job_id)
    job = await wait_for_job(stack, hungry, {"succeeded", "failed"})
    assert job["state"] == "succeeded", job
    usage = job["tasks"][0]["attempts"][0]["usage"]
    assert usage["cpu_seconds"] >= 0.5, usage
    assert usage["peak_rss_mb"] >= 120, usage  # the tree's sum, not its largest process
    assert "peak RSS" in await in_cli(stack, "status", hungry)

    # Drained with a deadline: nothing new goes there, and what still runs is preempted.
    await wait_until(lambda: sorted(workers_of(get_json(stack, f"/api/jobs/{sleeper}")))
                     == ["local-0", "local-1"], what="a sleeper on each worker")
    assert "local-0 draining" in await berth(stack, "drain", "local-0", "--deadline", "1",
                                             "--reason", "kernel upgrade")
    assert "OUT OF SERVICE: draining: by " in await in_cli(stack, "workers")
    moved = await wait_until(
        lambda: next((t for t in get_json(stack, f"/api/jobs/{sleeper}")["tasks"]
                      if len(t["attempts"]) == 2 and t["state"] == "running"), None),
        what="the drained sleeper to move")
    first, second = moved["attempts"]
    assert first["worker_id"] == "local-0" and first["worker_failure"]
    assert first["error"] == "worker local-0 drained: its drain deadline passed"
    assert second["worker_id"] == "local-1"
    await cancel_job(nc, sleeper, "done with it", None)

    # A host whose attempts fail for non-user causes (its disk: the scratch directory
    # cannot be made) across two jobs is quarantined.
    scratch = stack.data_dir / "workers" / "local-1" / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.write_text("not a directory")
    doomed = [str((await submit_job(nc, JobSpec(name=f"doomed{i}", command=["true"],
                                                 resources=SMALL))).job_id) for i in (1, 2)]
    for job_id in doomed:
        job = await wait_for_job(stack, job_id, {"succeeded", "failed"})
        assert job["state"] == "failed" and "worker error" in job["tasks"][0]["error"], job
    sick = await wait_until(lambda: worker(stack, "local-1")["out_of_service"],
                            what="local-1 quarantined")
    assert sick == ("quarantined: 2 attempts of 2 jobs failed here within 600s for "
                    "non-user causes")
    assert "OUT OF SERVICE: quarantined" in await in_cli(stack, "workers")

    # Never chosen while quarantined (and local-0 still drains): work waits and says why.
    waiting = str((await submit_job(nc, JobSpec(name="waits", command=["true"],
                                                resources=SMALL))).job_id)
    reason = await wait_until(
        lambda: get_json(stack, f"/api/jobs/{waiting}")["tasks"][0]["pending_reason"],
        what="a pending reason")
    assert reason.startswith("every matching worker is out of service: "), reason
    assert "local-0 draining: by " in reason and "local-1 quarantined: 2 attempts" in reason
    # Released by an operator (and its disk mended): it takes work again.
    scratch.unlink()
    await in_cli(stack, "uncordon", "local-1")
    job = await wait_for_job(stack, waiting, {"succeeded", "failed"})
    assert job["state"] == "succeeded" and workers_of(job) == ["local-1"]
    assert worker(stack, "local-1")["out_of_service"] == ""
    assert worker(stack, "local-1")["recent_failures"] == 0
    # A cordon ends the drain: no deadline any more.
    await in_cli(stack, "cordon", "local-0", "--reason", "keep it")
    assert worker(stack, "local-0")["out_of_service"] == "cordoned: by root: keep it"
