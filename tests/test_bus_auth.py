"""Least privilege on the bus, as nats-server enforces it: real server, real identities.
Every refusal is asserted from the server's own answer (its permissions-violation or
authorization error), and the stack keeps serving afterwards."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import httpx
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS

from berth.client import cancel_job, submit_job
from berth.shared import nats_io, subjects
from berth.shared.credentials import Credentials, Role, generate, load
from berth.shared.messages import (
    AttemptReported,
    JobSpec,
    Resources,
    RunAttempt,
    TaskAssigned,
    encode,
)
from berth.shared.states import TaskState
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until


class Client:
    """A connection as one identity that keeps every error the server sends it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: NATS | None = None

    async def connect(self, url: str, creds: Credentials | None) -> NATS:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(url, error_cb=on_error, max_reconnect_attempts=1,
                                     connect_timeout=3, **nats_io.auth_options(creds))
        return self.nc

    async def refused(self, what: str) -> bool:
        """Whether the server has answered with a permissions violation naming `what`."""
        assert self.nc is not None
        await self.nc.flush()
        for _ in range(30):
            # nats-py lower-cases the server's message.
            if any("permissions violation" in e and what.lower() in e for e in self.errors):
                return True
            await asyncio.sleep(0.05)
        return False

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


def _run(worker_id: str, incarnation: str) -> bytes:
    return encode(RunAttempt(epoch=1, incarnation=incarnation, job_id="j1-0000", task_index=0,
                             attempt_id=0, command=["sh", "-c", "id > pwned.txt"], env={},
                             resources=Resources(cpu=0.1, memory_mb=16)))


async def test_an_unknown_or_missing_identity_is_refused(make_stack) -> None:
    stack: Stack = make_stack(workers=0)
    anonymous = Client()
    with pytest.raises(nats.errors.NoServersError):
        await anonymous.connect(stack.nats.url, None)
    assert any("Authorization Violation" in e for e in anonymous.errors), anonymous.errors
    # A newcomer who makes their own key pair is no one the server knows.
    stranger = Client()
    with pytest.raises(nats.errors.NoServersError):
        await stranger.connect(stack.nats.url, generate(Role.ADMIN))
    assert any("Authorization Violation" in e for e in stranger.errors), stranger.errors


async def test_a_worker_may_speak_only_for_itself(make_stack, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=2)
    w0 = load(stack.creds_for(Role.WORKER, "local-0"))
    client = Client()
    nc = await client.connect(stack.nats.url, w0)
    try:
        # Commanding another worker, even with its real incarnation, is refused.
        await nc.publish(subjects.worker_commands("local-1"), _run("local-1", "any"))
        assert await client.refused(subjects.worker_commands("local-1"))
        # Reporting as another worker.
        report = encode(AttemptReported(job_id="j1-0000", task_index=0, attempt_id=0,
                                        worker_id="local-1", state=TaskState.SUCCEEDED,
                                        exit_code=0))
        await nc.publish(subjects.attempt_reports("local-1"), report)
        assert await client.refused(subjects.attempt_reports("local-1"))
        # Assigning tasks (only the scheduler may).
        assigned = encode(TaskAssigned(job_id="j1-0000", task_index=0, attempt_id=0,
                                       worker_id="local-0", incarnation="x", epoch=1))
        await nc.publish(subjects.task_events("j1-0000"), assigned)
        assert await client.refused(subjects.task_events("j1-0000"))
        # Heartbeats for another worker, and reading another worker's commands.
        await nc.publish(subjects.heartbeat("local-1"), b"{}")
        assert await client.refused(subjects.heartbeat("local-1"))
        await nc.subscribe(subjects.worker_commands("local-1"))
        assert await client.refused(subjects.worker_commands("local-1"))
        # Reading the events stream (where incarnations are) is not a worker's business.
        with pytest.raises(nats.errors.Error):
            await nc.jetstream(timeout=1).stream_info(subjects.EVENTS_STREAM)
        assert await client.refused("$JS.API.STREAM.INFO"), client.errors
        # Its own subjects are open to it.
        ack = await nc.jetstream().publish(
            subjects.attempt_reports("local-0"), assigned, stream=subjects.EVENTS_STREAM)
        assert ack.seq > 0
    finally:
        await client.close()
    # That `task_assigned` on the worker's own subject was stored, and believed by no fold.
    health = await wait_until(
        lambda: (h := get_json(stack, "/healthz"))["refused_events"] >= 1 and h, 15,
        "the dashboard to refuse the forged assignment")
    assert health["last_refused_seq"] == ack.seq
    await _still_serving(stack)


async def test_a_submit_client_submits_as_itself_and_nothing_else(make_stack) -> None:
    stack: Stack = make_stack(workers=1)
    ada = load(stack.creds_for(Role.SUBMIT, "ada"))
    bob = load(stack.creds_for(Role.SUBMIT, "bob"))
    client = Client()
    nc = await client.connect(stack.nats.url, ada)
    try:
        spec = JobSpec(name="mine", command=["true"], resources=Resources(cpu=0.1,
                                                                            memory_mb=16))
        outcome = await submit_job(nc, spec, user="ada")
        assert outcome.accepted, outcome.reason
        job = await wait_for_job(stack, str(outcome.job_id), {"succeeded"})
        assert job["spec"]["user"] == "ada"
        # Claiming to be someone else in the spec is rejected by the submitter.
        claimed = await submit_job(nc, JobSpec(name="x", command=["true"], user="bob"),
                                   user="ada")
        assert not claimed.accepted and "'bob' is not who you are ('ada')" in str(
            claimed.reason)
        # Another user's subjects, a worker's commands and the bare admin subject: refused.
        for subject in (subjects.submit_job("bob"), subjects.submit_cancel("bob"),
                        subjects.SUBMIT_JOB, subjects.worker_commands("local-0"),
                        subjects.task_events("j1-0000")):
            await nc.publish(subject, b"{}")
            assert await client.refused(subject), subject
        # Another user's outcomes (they hold the whole spec, env included).
        with pytest.raises(nats.errors.Error):
            await nc.jetstream(timeout=1).get_msg(subjects.EVENTS_STREAM, direct=True, subject=(
                subjects.submit_outcome("bob", outcome.submit_seq)))
        assert await client.refused("berth.events.submit.bob")
    finally:
        await client.close()
    # bob may not cancel ada's job: to him it does not exist.
    other = Client()
    nc = await other.connect(stack.nats.url, bob)
    try:
        refused = await cancel_job(nc, str(outcome.job_id), user="bob")
        assert not refused.accepted
        assert refused.reason == f"job_id: no job {outcome.job_id!r} of 'bob'"
    finally:
        await other.close()
    await _still_serving(stack)


async def test_a_worker_added_to_a_running_cluster_is_let_in_by_reload(make_stack) -> None:
    stack: Stack = make_stack(workers=0)
    pid = stack.nats.proc.pid
    stack.start_worker("late-1", 1, 256)  # a new identity; the server reloads, not restarts
    workers = await wait_until(lambda: get_json(stack, "/api/workers"), 30,
                               "the new worker to register")
    assert [w["worker_id"] for w in workers] == ["late-1"]
    assert stack.nats.proc.pid == pid and stack.nats.proc.poll() is None


async def _still_serving(stack: Stack) -> None:
    async with await nats_io.connect(stack.nats.url, "test", stack.nats.admin_creds()) as nc:
        outcome = await submit_job(nc, JobSpec(name="after", command=["true"],
                                               resources=Resources(cpu=0.1, memory_mb=16)))
        assert outcome.accepted
        await wait_for_job(stack, str(outcome.job_id), {"succeeded"})
    for label, proc in stack.children.items():
        assert proc.poll() is None, f"{label} exited"


async def test_a_task_gets_none_of_the_clusters_secrets(make_stack, nc: NATS) -> None:
    stack: Stack = make_stack(workers=1)
    outcome = await submit_job(nc, JobSpec(
        name="env", command=["python3", "-c", "import os; print(sorted(os.environ.items()))"],
        env={"MINE": "1"}, resources=Resources(cpu=0.1, memory_mb=16)))
    job = await wait_for_job(stack, str(outcome.job_id), {"succeeded"})
    logs = httpx.get(f"{stack.api_url}/api/jobs/{job['job_id']}/tasks/0/logs",
                     timeout=10).text
    seen = dict(ast.literal_eval(logs.strip()))
    assert seen["MINE"] == "1" and seen["BERTH_WORKER_ID"] == "local-0"
    assert "PATH" in seen
    for secret in ("BERTH_NATS_CREDS", "BERTH_NATS_URL", "BERTH_REDIS_URL", "BERTH_API_TOKEN",
                   "BERTH_DATA_DIR"):
        assert secret not in seen, secret
    assert not any(stack.env[name] in logs for name in ("BERTH_REDIS_URL", "BERTH_API_TOKEN"))
