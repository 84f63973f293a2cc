"""Simulated hosts (`berth run worker --simulate N`): many workers in one process that the
real scheduler, submitter and dashboard treat exactly like real ones."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from berth.services.worker_agent.service import parse_args
from berth.services.worker_agent.simulation import (
    SIGNAL_KILLED,
    RunTime,
    SimulatedProcess,
    simulated_hosts,
)
from berth.shared import redis_auth, redis_io
from berth.shared.checker import check_cluster
from berth.shared.messages import Coscheduling, JobSpec, Resources, TpuDevice
from berth.shared.reservations import ReservationStore
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_lifecycle_e2e import accepted


@pytest.mark.parametrize(("text", "low", "high"), [
    ("const:0.5", 0.5, 0.5), ("uniform:1:3", 1, 3), ("exp:2", 0, float("inf")),
    ("lognormal:0:0.5", 0, float("inf"))])
def test_run_time_distributions(text: str, low: float, high: float) -> None:
    rng = random.Random(1)
    draws = [RunTime.parse(text).draw(rng) for _ in range(200)]
    assert all(low <= d <= high for d in draws)


@pytest.mark.parametrize(("text", "problem"), [
    ("gauss:1", "one of const, uniform, exp, lognormal"), ("exp", "takes 1 parameter"),
    ("uniform:1:x", "must be numbers"), ("const:-1", "must not be negative")])
def test_bad_run_times_are_named(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        RunTime.parse(text)


def test_bad_simulation_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, problem in [(["--simulate", "-1"], "--simulate"),
                          (["--simulate", "2", "--sim-runtime", "soon"], "--sim-runtime"),
                          (["--simulate", "2", "--sim-fail-rate", "2"], "--sim-fail-rate")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert problem in capsys.readouterr().err


async def test_a_simulated_process_exits_after_its_time_or_at_once_when_stopped() -> None:
    loop = asyncio.get_running_loop()
    ran = SimulatedProcess(0.05, 3)
    started = loop.time()
    await ran.start()
    assert await ran.wait() == 3
    assert loop.time() - started >= 0.05

    stopped = SimulatedProcess(3600, 0)
    await stopped.start()
    waiting = asyncio.create_task(stopped.wait())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await stopped.stop(grace=10)
    assert await waiting == SIGNAL_KILLED
    await stopped.stop(grace=10)  # a second stop changes nothing
    assert await stopped.wait() == SIGNAL_KILLED

    # Stopped while "starting" (a kill that came with its run command): it never runs.
    early = SimulatedProcess(3600, 0)
    await early.stop(grace=10)
    await early.start()
    assert await early.wait() == SIGNAL_KILLED


def test_hosts_form_slices_of_consecutive_workers() -> None:
    hosts = simulated_hosts("sim", 6, Resources(cpu=1, memory_mb=10), {"region": "eu"}, 3)
    assert [h.worker_id for h in hosts] == [f"sim-0000{i}" for i in range(6)]
    assert [(h.attributes["tpu-name"], h.attributes["tpu-worker-id"]) for h in hosts] == [
        ("sim-slice-0", "0"), ("sim-slice-0", "1"), ("sim-slice-0", "2"),
        ("sim-slice-1", "0"), ("sim-slice-1", "1"), ("sim-slice-1", "2")]
    assert all(h.attributes["region"] == "eu" for h in hosts)


async def test_simulated_workers_run_jobs_and_gangs_like_real_ones(
        make_stack: Any, nc: NATS) -> None:
    stack: Stack = make_stack(workers=0)
    stack.start_service("worker", "--id", "sim", "--simulate", "16", "--cpu", "2",
                        "--memory-mb", "1024", "--tpu", "v5p:2x2x1:4", "-a", "region=eu",
                        "--sim-runtime", "uniform:0.1:0.3", "--sim-slice-size", "4",
                        "--sim-seed", "3", label="sim")
    await wait_until(lambda: sum(w["healthy"] for w in get_json(stack, "/api/workers")) == 16,
                     what="16 simulated workers healthy")
    workers = {w["worker_id"]: w for w in get_json(stack, "/api/workers")}
    assert workers["sim-00005"]["attributes"] == {
        "region": "eu", "tpu-name": "sim-slice-1", "tpu-worker-id": "1"}

    tpu = Resources(cpu=1, memory_mb=100, device=TpuDevice(variant="v5p", topology="2x2x1",
                                                          count=4))
    gangs = [await accepted(nc, JobSpec(
        name=f"gang-{i}", replicas=4, command=["train"], resources=tpu,
        coscheduling=Coscheduling(group_by="tpu-name", order_by="tpu-worker-id")))
        for i in range(3)]
    singles = [await accepted(nc, JobSpec(
        name=f"single-{i}", replicas=5, command=["x"],
        resources=Resources(cpu=0.5, memory_mb=50, device=TpuDevice(
            variant="v5p", topology="2x2x1", count=1))))
        for i in range(4)]
    for job_id in gangs + singles:
        job = await wait_for_job(stack, job_id, {"succeeded", "failed", "killed"})
        assert job["state"] == "succeeded", job
    for job_id in gangs:
        job = get_json(stack, f"/api/jobs/{job_id}")
        attempts = [t["attempts"][-1] for t in job["tasks"]]
        slices = {workers[a["worker_id"]]["attributes"]["tpu-name"] for a in attempts}
        assert len(slices) == 1, "a gang on one slice"
        assert [workers[a["worker_id"]]["attributes"]["tpu-worker-id"] for a in attempts] \
            == ["0", "1", "2", "3"]
        assert all(a["started_at"] and a["exit_code"] == 0 for a in attempts)

    redis = redis_io.open_client(stack.redis.settings_for(redis_auth.DOCTOR))
    try:
        report = await check_cluster(nc.jetstream(), ReservationStore(redis), settle=0.5)
    finally:
        await redis.aclose()
    assert report.ok, report.violations()


async def test_a_finished_simulated_process_is_freed_without_the_collector() -> None:
    """Its timer's handle held it (a cycle): 20,000 of them in W1 kept the simulated hosts'
    process collecting garbage every ~1.5 s."""
    gc.disable()
    try:
        for stop in (False, True):
            process = SimulatedProcess(0.0 if not stop else 60.0, 0)
            await process.start()
            if stop:
                await process.stop(0.0)
            assert await process.wait() == (SIGNAL_KILLED if stop else 0)
            await asyncio.sleep(0)  # the loop lets go of the fired handle
            freed = weakref.ref(process)
            del process
            assert freed() is None
    finally:
        gc.enable()
