"""The placement collision incident (docs/placement.md tells it),
as tests: real NATS, real Redis, real scheduler(s) and worker processes on loopback, TPU
slices simulated by worker attributes and device counts. Each test runs the checker."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS

from berth.client import publish_submit, submit_job, wait_for_outcome
from berth.shared import nats_io, redis_auth, redis_io
from berth.shared.checker import check_cluster
from berth.shared.messages import (
    Constraint,
    Coscheduling,
    JobSpec,
    Op,
    Resources,
    TpuDevice,
    encode,
)
from berth.shared.reservations import ReservationStore
from berth.stack import Stack
from tests.conftest import get_json, run_doctor, wait_for_job, wait_until

# Records what the task saw, then runs until $DIR/<job>.done exists (exit 0) or, for the
# task index in $FAIL_INDEX on attempt 0, until $DIR/<job>.fail exists (exit 1).
GANG_TASK = """
import os, pathlib, signal, sys, time
env = os.environ
d = pathlib.Path(env['DIR'])
job, index, attempt = env['BERTH_JOB_ID'], env['BERTH_TASK_INDEX'], env['BERTH_ATTEMPT_ID']
if env.get('IGNORE_TERM'):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(d / f'{job}-{index}-{attempt}').write_text(' '.join([
    env['BERTH_WORKER_ID'], env['BERTH_COORDINATOR_ADDRESS'], env['BERTH_PORT_COORDINATOR']]))
failing = index == env.get('FAIL_INDEX') and attempt == '0'
while True:
    if (d / f'{job}.done').exists():
        sys.exit(0)
    if failing and (d / f'{job}.fail').exists():
        sys.exit(1)
    time.sleep(0.05)
"""

SLICE_HOSTS = 3


def start_slices(stack: Stack, *names: str) -> None:
    for name in names:
        for i in range(SLICE_HOSTS):
            stack.start_worker(f"{name}-{i}", 1, 512, "--tpu", "v5p:2x2x1:4",
                               "-a", f"tpu-name={name}", "-a", f"tpu-worker-id={i}",
                               "-a", "region=us-east5")


def gang_spec(name: str, flags: Path, **kw: Any) -> JobSpec:
    env = {"DIR": str(flags), **kw.pop("env", {})}
    return JobSpec(
        name=name, replicas=SLICE_HOSTS, command=["python3", "-c", GANG_TASK], env=env,
        resources=Resources(cpu=0.25, memory_mb=64,
                            device=TpuDevice(variant="v5p", topology="2x2x1", count=4)),
        coscheduling=Coscheduling(group_by="tpu-name", order_by="tpu-worker-id"),
        constraints=[Constraint(key="region", op=Op.EQ, value="us-east5")],
        ports=["coordinator"], **kw,
    )


async def submit_at_once(nc: NATS, specs: list[JobSpec]) -> list[str]:
    """Publishes every submit before waiting for any outcome: one scheduling tick's worth."""
    seqs = [await publish_submit(nc, encode(spec)) for spec in specs]
    outcomes = [await wait_for_outcome(nc, seq) for seq in seqs]
    assert all(o.accepted for o in outcomes), outcomes
    return [str(o.job_id) for o in outcomes]


async def assert_no_violations(stack: Stack) -> None:
    nc = await nats_io.connect(stack.nats.url, "berth-bench", stack.nats.admin_creds())
    redis = redis_io.open_client(stack.redis.settings_for(redis_auth.DOCTOR))
    try:
        report = await check_cluster(nc.jetstream(), ReservationStore(redis), settle=0.5)
    finally:
        await nc.close()
        await redis.aclose()
    assert report.violations() == [] and report.double_booked_hosts == 0, report


def job_now(stack: Stack, job_id: str) -> dict[str, Any]:
    result: dict[str, Any] = get_json(stack, f"/api/jobs/{job_id}")
    return result


def job_if_shown(stack: Stack, job_id: str) -> dict[str, Any] | None:
    """The job, or None while the dashboard has not folded its submission yet."""
    resp = httpx.get(f"{stack.api_url}/api/jobs/{job_id}", timeout=10)
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()
    return result


def current_hosts(job: dict[str, Any]) -> list[str]:
    return [t["attempts"][-1]["worker_id"] for t in job["tasks"]]


async def running(stack: Stack, job_id: str) -> dict[str, Any]:
    def all_running() -> dict[str, Any] | None:
        job = job_now(stack, job_id)
        return job if job["task_counts"] == {"running": SLICE_HOSTS} else None
    result: dict[str, Any] = await wait_until(all_running, what=f"{job_id} running whole")
    return result


def assert_whole_slice_in_order(job: dict[str, Any], flags: Path) -> str:
    """Every task on one slice, task i on tpu-worker-id i, all told task 0's address."""
    hosts = current_hosts(job)
    slice_name = hosts[0].rsplit("-", 1)[0]
    assert hosts == [f"{slice_name}-{i}" for i in range(SLICE_HOSTS)], hosts
    seen = {(flags / f"{job['job_id']}-{i}-{t['attempts'][-1]['attempt_id']}").read_text()
            for i, t in enumerate(job["tasks"])}
    coordinators = {line.split()[1] for line in seen}
    zero = job["tasks"][0]["attempts"][-1]
    assert coordinators == {f"127.0.0.1:{zero['ports']['coordinator']}"}, seen
    return slice_name


async def wait_for_records(flags: Path, job_id: str, attempt: int = 0) -> None:
    await wait_until(lambda: all((flags / f"{job_id}-{i}-{attempt}").exists()
                                 for i in range(SLICE_HOSTS)), what=f"{job_id} tasks started")


async def test_three_gangs_in_one_tick_onto_two_slices(make_stack, nc, tmp_path: Path) -> None:
    """(a) Incident B's shape: three same-variant, same-region, same-priority gangs at once,
    capacity for two. Two run on disjoint slices, the third waits with a reason, then runs."""
    stack: Stack = make_stack(workers=0)
    start_slices(stack, "slice-a", "slice-b")
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2 * SLICE_HOSTS,
                     what="6 workers")
    g1, g2, g3 = await submit_at_once(nc, [gang_spec(f"lr0{i}", tmp_path) for i in (3, 5, 7)])
    jobs = [await running(stack, g) for g in (g1, g2)]
    for g in (g1, g2):
        await wait_for_records(tmp_path, g)
    slices = {assert_whole_slice_in_order(job_now(stack, g), tmp_path) for g in (g1, g2)}
    assert slices == {"slice-a", "slice-b"}
    assert set(current_hosts(jobs[0])).isdisjoint(current_hosts(jobs[1]))
    waiting = await wait_until(
        lambda: (job := job_if_shown(stack, g3)) and job["tasks"][0]["pending_reason"],
        what="the third gang's pending reason")
    assert "no tpu-name group can take all 3 tasks" in waiting and "held by" in waiting
    assert job_now(stack, g3)["task_counts"] == {"pending": SLICE_HOSTS}
    await assert_no_violations(stack)

    (tmp_path / f"{g1}.done").touch()
    await wait_for_job(stack, g1, {"succeeded"})
    await running(stack, g3)
    await wait_for_records(tmp_path, g3)
    assert assert_whole_slice_in_order(job_now(stack, g3), tmp_path) == \
        assert_whole_slice_in_order(job_now(stack, g1), tmp_path)
    await assert_no_violations(stack)
    for g in (g2, g3):
        (tmp_path / f"{g}.done").touch()
    for g in (g2, g3):
        await wait_for_job(stack, g, {"succeeded"})
    await assert_no_violations(stack)


async def test_gangs_submitted_apart_placed_in_one_tick_when_capacity_frees(
        make_stack, nc, tmp_path: Path) -> None:
    """(b) Incident D: submitted minutes apart, dispatched in the same tick when two slices
    free up at once."""
    stack: Stack = make_stack(workers=0)
    start_slices(stack, "slice-a", "slice-b")
    blockers = await submit_at_once(nc, [gang_spec(f"blocker{i}", tmp_path) for i in (1, 2)])
    for b in blockers:
        await running(stack, b)
    (first,) = await submit_at_once(nc, [gang_spec("p67m33", tmp_path)])
    await asyncio.sleep(1.5)
    (second,) = await submit_at_once(nc, [gang_spec("p33m67", tmp_path)])
    for g in (first, second):
        await wait_until(lambda g=g: (job := job_if_shown(stack, g))
                         and job["tasks"][0]["pending_reason"], what="pending reasons")
    await assert_no_violations(stack)
    for b in blockers:
        (tmp_path / f"{b}.done").touch()
    jobs = [await running(stack, g) for g in (first, second)]
    assert set(current_hosts(jobs[0])).isdisjoint(current_hosts(jobs[1]))
    for g in (first, second):
        await wait_for_records(tmp_path, g)
    assert {assert_whole_slice_in_order(job_now(stack, g), tmp_path) for g in (first, second)} \
        == {"slice-a", "slice-b"}
    await assert_no_violations(stack)
    for g in (first, second):
        (tmp_path / f"{g}.done").touch()
        await wait_for_job(stack, g, {"succeeded"})
    await assert_no_violations(stack)


async def test_recycled_gang_waits_for_its_old_attempts_to_exit(
        make_stack, nc, tmp_path: Path) -> None:
    """(d) A gang task fails and the gang is retried while its siblings are still shutting
    down (they ignore SIGTERM: only SIGKILL after the grace ends them): the new gang never
    lands on a host an old attempt still holds."""
    stack: Stack = make_stack(workers=0)
    start_slices(stack, "slice-a")
    spec = gang_spec("recycle", tmp_path, max_retries_failure=1,
                     env={"IGNORE_TERM": "1", "FAIL_INDEX": "1"})
    (g,) = await submit_at_once(nc, [spec])
    await running(stack, g)
    await wait_for_records(tmp_path, g)
    (tmp_path / f"{g}.fail").touch()
    checks = 0
    while not all((tmp_path / f"{g}-{i}-1").exists() for i in range(SLICE_HOSTS)):
        await assert_no_violations(stack)  # throughout the recycle
        checks += 1
    assert checks >= 2
    job = await running(stack, g)
    for t in job["tasks"]:
        old, new = t["attempts"][-2], t["attempts"][-1]
        assert old["worker_id"] == new["worker_id"] == f"slice-a-{t['index']}"
        assert old["exited"] and new["assigned_at"] >= old["finished_at"], t
    siblings = [job["tasks"][i]["attempts"][0] for i in (0, 2)]
    assert all(a["state"] == "killed" and a["exit_code"] == -signal.SIGKILL for a in siblings)
    assert [t["preemption_count"] for t in job["tasks"]] == [1, 0, 1]
    assert job["tasks"][1]["failure_count"] == 1
    (tmp_path / f"{g}.done").touch()
    await wait_for_job(stack, g, {"succeeded"})
    await assert_no_violations(stack)


async def test_killing_the_leader_mid_tick_loses_nothing(make_stack, nc, tmp_path: Path
                                                        ) -> None:
    """SIGKILL the leader right after a burst of gangs is submitted (mid-tick, or between a
    commit and its log entry): the standby takes over from the log and Redis; every gang
    runs exactly once, whole, and nothing is double-booked."""
    stack: Stack = make_stack(workers=0)
    start_slices(stack, "slice-a", "slice-b")
    stack.start_service("scheduler", label="scheduler-2")
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2 * SLICE_HOSTS,
                     what="6 workers")
    seqs = [await publish_submit(nc, encode(gang_spec(f"k{i}", tmp_path))) for i in range(4)]
    stack.children.pop("scheduler").send_signal(signal.SIGKILL)
    gangs = [str((await wait_for_outcome(nc, seq)).job_id) for seq in seqs]
    for g in gangs[:2]:
        await running(stack, g)
    await assert_no_violations(stack)
    for g in gangs:
        (tmp_path / f"{g}.done").touch()
    for g in gangs:
        await wait_for_job(stack, g, {"succeeded"}, timeout=60)
    await assert_no_violations(stack)


@pytest.mark.parametrize("pause", [5.0])
async def test_a_paused_leader_and_its_successor_never_double_book(
        make_stack, nc, tmp_path: Path, pause: float) -> None:
    """(c) Two schedulers that both believe they lead for a moment: the leader is paused
    (SIGSTOP) past its lease, a standby takes over and places gangs, the old one resumes.
    Its writes carry the old epoch and are refused; workers refuse its commands."""
    stack: Stack = make_stack(workers=0)
    start_slices(stack, "slice-a", "slice-b")
    standby = stack.start_service("scheduler", label="scheduler-2")
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2 * SLICE_HOSTS,
                     what="6 workers")
    leader = stack.children["scheduler"]
    leader.send_signal(signal.SIGSTOP)
    try:
        gangs = await submit_at_once(nc, [gang_spec(f"c{i}", tmp_path) for i in range(3)])
        await asyncio.sleep(pause)  # past the 3 s lease: the standby leads now
        jobs = [await running(stack, g) for g in gangs[:2]]
    finally:
        leader.send_signal(signal.SIGCONT)
    await asyncio.sleep(2)  # the old leader wakes, folds, and finds its epoch refused
    assert set(current_hosts(jobs[0])).isdisjoint(current_hosts(jobs[1]))
    await assert_no_violations(stack)
    for g in gangs:
        (tmp_path / f"{g}.done").touch()
    for g in gangs:
        await wait_for_job(stack, g, {"succeeded"}, timeout=60)
        job = job_now(stack, g)
        assert all(len(t["attempts"]) == 1 for t in job["tasks"]), job  # nothing recycled
    await assert_no_violations(stack)
    assert standby.poll() is None and leader.poll() is None
    log = (stack.data_dir / "logs" / "scheduler-2.log").read_text()
    assert "leading with epoch" in log
    old = (stack.data_dir / "logs" / "scheduler.log").read_text()
    assert "lost leadership" in old and "standing by" in old


async def test_doctor_prints_zero_on_a_healthy_stack(make_stack, nc, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=1)
    outcome = await submit_job(nc, JobSpec(name="ok", command=["true"],
                                           resources=Resources(cpu=0.5, memory_mb=64)))
    await wait_for_job(stack, str(outcome.job_id), {"succeeded"})
    out = await run_doctor(stack)
    assert "double_booked_hosts=0" in out and "violations=0" in out
