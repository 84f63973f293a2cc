"""TPU chips pinned per task, end to end on the real stack (issue 20): a worker offering
`--tpu v5e:2x2:4` on a host without TPUs (chips 0..3, unchecked). Two two-chip tasks running
at once see disjoint TPU_VISIBLE_CHIPS with their own process port, a third waits with a
pending reason naming the chips, a task that asked for no TPU sees "", and the doctor
finds no chip held twice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nats.aio.client import Client as NATS

from berth.shared.messages import JobSpec, Resources, TpuDevice
from berth.stack import Stack
from tests.conftest import run_doctor, wait_for_job, wait_until
from tests.test_gpu_pinning import pending_reason, tasks_of
from tests.test_lifecycle_e2e import accepted

# Records the TPU variables the task sees, then holds its chips until the test lets go.
SEE_AND_HOLD = """
import json, os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
name = os.environ["BERTH_JOB_ID"] + "-" + os.environ["BERTH_TASK_INDEX"]
seen = {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "CLOUD_TPU"))}
(out / (name + ".seen")).write_text(json.dumps(seen))
while not (out / "go").exists():
    time.sleep(0.05)
"""

TWO_CHIPS = Resources(cpu=0.5, memory_mb=64,
                      device=TpuDevice(variant="v5e", topology="2x2", count=2))


def seen(out: Path) -> dict[str, dict[str, str]]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.seen")}


async def test_two_chip_tasks_get_disjoint_chips_and_a_no_tpu_task_none(
        make_stack, nc: NATS, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=0, extra_env={"BERTH_PENDING_REASON_INTERVAL": "0.2"})
    stack.start_worker("tpu0", 4, 2048, "--tpu", "v5e:2x2:4")
    out = tmp_path / "seen"
    out.mkdir()
    hold = [sys.executable, "-c", SEE_AND_HOLD, str(out)]
    pair = await accepted(nc, JobSpec(name="pair", command=hold, replicas=2,
                                      resources=TWO_CHIPS))
    await wait_until(lambda: len(seen(out)) == 2, 30, "both two-chip tasks to start")
    third = await accepted(nc, JobSpec(name="third", command=hold, resources=TWO_CHIPS))
    reason = await wait_until(lambda: pending_reason(stack, third), 30,
                              "the third task's pending reason")
    assert "v5e 2x2 TPU chips" in reason and "need 2, largest free 0" in reason, reason
    plain = await accepted(nc, JobSpec(name="plain", command=hold,
                                       resources=Resources(cpu=0.5, memory_mb=64)))
    await wait_until(lambda: f"{plain}-0" in seen(out), 30, "the no-TPU task to start")

    views = seen(out)
    first, second = views[f"{pair}-0"], views[f"{pair}-1"]
    assert {first["TPU_VISIBLE_CHIPS"], second["TPU_VISIBLE_CHIPS"]} == {"0,1", "2,3"}
    assert {first["TPU_PROCESS_PORT"], second["TPU_PROCESS_PORT"]} == {"8476", "8478"}
    for view in (first, second):
        assert view["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
        assert view["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert views[f"{plain}-0"] == {"TPU_VISIBLE_CHIPS": ""}  # asked for no TPU: sees none
    assert f"{third}-0" not in views
    held = {tuple(t["attempts"][0]["devices"]) for t in tasks_of(stack, pair)}
    assert held == {(0, 1), (2, 3)}
    assert "double_booked_devices=0" in await run_doctor(stack)

    (out / "go").write_text("")
    for job_id in (pair, plain, third):
        job = await wait_for_job(stack, job_id, {"succeeded", "failed"}, timeout=30)
        assert job["state"] == "succeeded", job
    assert seen(out)[f"{third}-0"]["TPU_VISIBLE_CHIPS"] in {"0,1", "2,3"}
