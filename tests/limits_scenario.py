"""Quotas and tokens through the real services, with real worker processes, run beside
another scenario on its stack (tests/test_gpu_pinning.py) to share the stack and its
`berth doctor`: a user over quota waits with the reason and runs once their other task
ends; a token of limit 2 never has more than 2 of its 4 tasks running; the doctor's quota
and token counts read 0 while they are held."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS

from berth.client import submit_job
from berth.shared.messages import JobSpec, Resources
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_lifecycle_e2e import job_now


async def in_cli(stack: Stack, *args: str) -> str:
    # Imported here: that module imports tests/test_gpu_pinning.py, which imports this one.
    from tests.test_node_health_e2e import in_cli as run_in_process

    return await run_in_process(stack, *args)

# Writes $DIR/<job>-<index>.started, then waits for $DIR/go-<job>, then exits 0.
GATED = """
import os, pathlib, time
d = pathlib.Path(os.environ['DIR']); name = os.environ['NAME']
(d / f"{name}-{os.environ['BERTH_TASK_INDEX']}.started").touch()
while not (d / f'go-{name}').exists():
    time.sleep(0.05)
"""
QUOTA_REASON = "user quota ann: cpu 0.5/0.5 cores in use, needs 0.25 more"
TOKEN_REASON = "waiting for token io (2/2 in use)"
# What `berth doctor` must print (with the scenario's work live).
DOCTOR_ZEROS = ("over_quota=0", "over_token_limit=0", "limit_use_miscounted=0")


def gated(directory: Path, name: str, cpu: float = 0.1, **spec: object) -> JobSpec:
    return JobSpec(name=name, command=["python3", "-c", GATED],
                   resources=Resources(cpu=cpu, memory_mb=32),
                   env={"DIR": str(directory), "NAME": name}, **spec)  # type: ignore[arg-type]


async def accepted(nc: NATS, spec: JobSpec, user: str) -> str:
    outcome = await submit_job(nc, spec, user=user)
    assert outcome.accepted, outcome.reason
    return str(outcome.job_id)


def reasons(stack: Stack, job_id: str) -> set[str]:
    return {t["pending_reason"] for t in job_now(stack, job_id)["tasks"]
            if t["state"] == "pending"}


def make_dir(directory: Path) -> None:
    directory.mkdir()


def started(directory: Path, name: str) -> int:
    """How many tasks of job `name` have started."""
    return len(list(directory.glob(f"{name}-*.started")))


@dataclass
class Limited:
    directory: Path
    tokens: str  # bob's 4 tasks asking for token io (limit 2)
    first: str  # ann's 0.5-core task: all her quota
    second: str  # ann's 0.25-core task, over quota while the first runs


async def start(stack: Stack, nc: NATS, directory: Path) -> Limited:
    """Sets token io to 2 and ann's quota to 0.5 cores with the CLI, and submits. The
    steps after it (`waiting`, `release`, `finish`) each wait for little, so the other
    scenario's waits overlap theirs."""
    make_dir(directory)
    await in_cli(stack, "tokens", "set", "io", "2")
    await in_cli(stack, "quota", "set", "ann", "--cpu", "0.5")
    await wait_until(lambda: get_json(stack, "/api/limits")["tokens"], what="the token")

    # A token nobody set is a rejected spec, naming the field.
    unknown = await submit_job(nc, gated(directory, "u", tokens={"nope": 1}), user="bob")
    assert not unknown.accepted
    assert unknown.reason == ("tokens.nope: no such token (an admin creates it: "
                              "`berth tokens set nope N`)")

    # Ann's two in submission order: the first is placed first and takes all her quota.
    return Limited(directory,
                   await accepted(nc, gated(directory, "tok", replicas=4, tokens={"io": 1}),
                                  "bob"),
                   await accepted(nc, gated(directory, "first", cpu=0.5), "ann"),
                   await accepted(nc, gated(directory, "second", cpu=0.25), "ann"))


async def waiting(stack: Stack, run: Limited) -> None:
    """What is over the limits waits, saying why; the lists show the use."""
    directory = run.directory
    await wait_until(lambda: (directory / "first-0.started").exists(), what="ann's first")
    await wait_until(lambda: reasons(stack, run.second) == {QUOTA_REASON},
                     what="the quota reason")
    await wait_until(lambda: reasons(stack, run.tokens) == {TOKEN_REASON},
                     what="the token reason")
    assert started(directory, "tok") == 2
    assert not (directory / "second-0.started").exists()
    listed = await in_cli(stack, "tokens", "list", "--json")
    assert json.loads(listed) == [{"name": "io", "limit": 2, "in_use": 2}]
    quotas = {q["user"]: q for q in json.loads(await in_cli(stack, "quota", "list", "--json"))}
    assert quotas["ann"]["cpu"] == 500 and quotas["ann"]["cpu_used"] == 500


def release(run: Limited) -> None:
    """Lets every task of the scenario end."""
    for name in ("first", "second", "tok"):
        (run.directory / f"go-{name}").touch()


async def finish(stack: Stack, run: Limited) -> None:
    """Once released: ann's second ran only after her first had ended; the token's tasks
    never ran more than 2 at once, by their start and end times."""
    done_first = await wait_for_job(stack, run.first, {"succeeded"})
    done_second = await wait_for_job(stack, run.second, {"succeeded"})
    assert (done_second["tasks"][0]["attempts"][0]["started_at"]
            >= done_first["tasks"][0]["attempts"][0]["finished_at"])
    done = await wait_for_job(stack, run.tokens, {"succeeded"})
    spans = [(a["started_at"], a["finished_at"]) for t in done["tasks"] for a in t["attempts"]]
    assert len(spans) == 4
    for start_at, _ in spans:
        assert sum(1 for s, f in spans if s <= start_at < f) <= 2, spans
    await wait_until(lambda: get_json(stack, "/api/limits")["tokens"][0]["in_use"] == 0,
                     what="the tokens given back")
