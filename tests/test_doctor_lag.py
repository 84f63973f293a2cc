"""`berth doctor` against a leader behind the log (real processes): a reservation the
leader has yet to release is lag, counted as such, not a violation; once the leader has
caught up, nothing is owed and nothing leaked."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

from nats.aio.client import Client as NATS

from berth.client import submit_job
from berth.shared.messages import JobSpec, Resources
from berth.stack import Stack
from tests.conftest import run_doctor, wait_for_job

WAIT_FOR_FLAG = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)"


def owed(doctor_output: str) -> int:
    found = re.search(r"^releases_owed=(\d+) ", doctor_output, re.MULTILINE)
    assert found, doctor_output
    return int(found.group(1))


async def test_a_release_a_stopped_leader_owes_is_lag_not_a_leak(
        make_stack, nc: NATS, tmp_path: Path) -> None:
    # Workers keep their tasks through the pause (no fencing within it).
    stack: Stack = make_stack(workers=1, extra_env={"BERTH_WORKER_DEAD_AFTER": "60"})
    flag = tmp_path / "go"
    outcome = await submit_job(nc, JobSpec(
        name="lag", command=["python3", "-c", WAIT_FOR_FLAG, str(flag)],
        resources=Resources(cpu=0.1, memory_mb=32)))
    job_id = str(outcome.job_id)
    await wait_for_job(stack, job_id, {"running"})
    out = await run_doctor(stack)
    log = (stack.data_dir / "logs" / "scheduler.log").read_text()[-3000:]
    assert owed(out) == 0 and "violations=0" in out, out + log
    leader = stack.children["scheduler"]
    leader.send_signal(signal.SIGSTOP)
    try:
        flag.touch()
        # The worker logs the exit; the leader, stopped, cannot fold it nor release.
        await wait_for_job(stack, job_id, {"succeeded"})
        out = await run_doctor(stack)  # exit status 0: no violation
    finally:
        leader.send_signal(signal.SIGCONT)
    assert owed(out) == 1 and "violations=0" in out, out
    assert "VIOLATION" not in out, out
    # Resumed (and, past its lease, a new term that reconciles), the leader releases it.
    deadline = time.monotonic() + 60
    while True:
        out = await run_doctor(stack)
        if not owed(out) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    log = (stack.data_dir / "logs" / "scheduler.log").read_text()[-3000:]
    assert owed(out) == 0 and "violations=0" in out, out + log
