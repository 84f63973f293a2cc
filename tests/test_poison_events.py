"""Whatever is written to the events stream (here with admin rights, which may write
anything), no fold stops on it: undecodable or forged messages are skipped and counted, a
job submitted afterwards still succeeds, and a fresh scheduler, a fresh dashboard and
`berth doctor` all fold past them."""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client as NATS

from berth.client import submit_job
from berth.shared import subjects
from berth.shared.messages import JobSpec, LeaderElected, Resources, TaskAssigned, encode
from berth.stack import Stack, wait_for_api
from tests.conftest import get_json, run_doctor, wait_for_job, wait_until
from tests.test_projection import accepted

SMALL = Resources(cpu=0.1, memory_mb=16)

UNDECODABLE = [
    b'{"x":' + b"[" * 1000 + b"]" * 1000 + b"}",
    b"[" * 20_000 + b"]" * 20_000,
    b'{"type":"attempt_reported","error":"' + b"a" * 900_000 + b'"}',
    b"\xff\x00 not json",
    b"",
]
POISON = [
    *UNDECODABLE,
    encode(LeaderElected(scheduler_id="forger", epoch=10**30)),
    encode(TaskAssigned(job_id="j1-aaaa", task_index=0, attempt_id=0, worker_id="local-0",
                        incarnation="x", epoch=10**9)),
]
# One subject of every kind in the events stream; the forged events are on subjects their
# kind may not come from (a forged LeaderElected on its own subject is another matter: an
# admin may elect, within MAX_EPOCH_STEP; see tests/test_epoch_trust.py).
SUBJECTS = [subjects.attempt_reports("x"), subjects.worker_events("x"),
            subjects.task_events("j1-aaaa"), subjects.submit_outcome("mallory", 999_999),
            subjects.PENDING_REASONS, subjects.worker_verdicts("x")]


async def test_poison_in_the_events_stream_stops_no_fold(make_stack, nc: NATS,
                                                         tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=1, extra_env={"BERTH_SNAPSHOT_INTERVAL": "0.3"})
    stack.start_service("scheduler", label="scheduler-2")
    js = nc.jetstream()
    refused = 0
    for subject in SUBJECTS:
        for payload in POISON:
            await js.publish(subject, payload, stream=subjects.EVENTS_STREAM)
            # All but one: the assignment on its own job's subject is the scheduler's to
            # write, so it is believed (and changes nothing: there is no such job).
            refused += subject != subjects.task_events("j1-aaaa") or b"task_assigned" not in payload
    # Garbage on the core subjects services listen on, too. (A well-formed announcement
    # of an absurd epoch is another matter, for the epoch fence: tests/test_epoch_trust.py.)
    for subject in (subjects.heartbeat("local-0"), subjects.LEADER,
                    subjects.worker_commands("local-0")):
        for payload in UNDECODABLE:
            await nc.publish(subject, payload)
    await nc.flush()

    job = await submit_job(nc, _spec("after-poison"))
    assert job.accepted
    await wait_for_job(stack, str(job.job_id), {"succeeded"}, timeout=30)
    health = get_json(stack, "/healthz")
    assert health["refused_events"] == refused

    # A fresh scheduler replays past it: the leader goes, the standby takes over.
    stack.stop_child("scheduler")
    second = await accepted(nc, _spec("after-take-over"))
    await wait_for_job(stack, second, {"succeeded"}, timeout=60)

    # A fresh dashboard, with no snapshot, folds the whole log past it.
    stack.stop_child("dashboard")
    for snapshot in (stack.data_dir / "dashboard").glob("*"):
        snapshot.unlink()
    stack.start_service("dashboard")
    wait_for_api(stack)
    health = await wait_until(lambda: (h := get_json(stack, "/healthz"))["caught_up"] and h,
                              30, "the new dashboard to catch up")
    assert health["refused_events"] == refused
    assert get_json(stack, f"/api/jobs/{second}")["state"] == "succeeded"

    out = await run_doctor(stack)
    assert f"refused_events={refused} " in out
    assert "double_booked_hosts=0" in out
    assert stack.children["scheduler-2"].poll() is None


def _spec(name: str) -> JobSpec:
    return JobSpec(name=name, command=["true"], resources=SMALL)
