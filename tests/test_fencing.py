"""Fencing on the leader's side: a leader paused past its lease says nothing in its name once
it resumes (no command, no acknowledgement), even before it has heard it lost the lease."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from berth.shared import nats_io, subjects
from berth.shared.messages import JobSpec, Resources, command_decoder, decode
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_projection import accepted

SMALL = Resources(cpu=0.1, memory_mb=16)


async def test_a_leader_paused_past_its_lease_commands_nothing_when_it_resumes(
        make_stack, nc: NATS) -> None:
    stack: Stack = make_stack(workers=2, extra_env={"BERTH_WORKER_DEAD_AFTER": "8"})
    stack.start_service("scheduler", label="scheduler-2")
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2, what="2 workers")
    first = await accepted(nc, JobSpec(name="before", command=["true"], resources=SMALL))
    await wait_for_job(stack, first, {"succeeded"})
    old_epoch = await _current_epoch(nc)

    commands: list[tuple[float, int]] = []

    async def heard(msg: Msg) -> None:
        commands.append((time.monotonic(), decode(command_decoder, msg.data).epoch))

    sub = await nc.subscribe(subjects.worker_commands("*"), cb=heard)
    history = await nats_io.last_event_seq(nc.jetstream())
    leader = stack.children["scheduler"]
    leader.send_signal(signal.SIGSTOP)
    try:
        # The standby takes the lease and places new work while the old leader sleeps.
        jobs = [await accepted(nc, JobSpec(name=f"during-{i}", command=["sleep", "0.2"],
                                           resources=SMALL)) for i in range(6)]
        for job_id in jobs:
            await wait_for_job(stack, job_id, {"succeeded"}, timeout=40)
    finally:
        resumed = time.monotonic()
        leader.send_signal(signal.SIGCONT)
    # More work after it resumes: it sees the events and hears heartbeats, and must not act.
    later = [await accepted(nc, JobSpec(name=f"after-{i}", command=["sleep", "0.2"],
                                        resources=SMALL)) for i in range(6)]
    for job_id in later:
        await wait_for_job(stack, job_id, {"succeeded"}, timeout=40)
    await asyncio.sleep(2)
    await sub.unsubscribe()
    stale = [epoch for at, epoch in commands if at >= resumed and epoch <= old_epoch]
    assert stale == [], f"{len(stale)} commands of the deposed leader after it resumed"
    assert any(epoch > old_epoch for _, epoch in commands)
    assert leader.poll() is None  # it stands by; it did not die
    # The standby kept its fold warm: its take-over folded only what came after it.
    log = (stack.data_dir / "logs" / "scheduler-2.log").read_text()
    took_over = re.search(r"\((\d+) events folded in the take-over\)", log)
    assert took_over and int(took_over[1]) < history, log[-2000:]


async def _current_epoch(nc: NATS) -> int:
    msg = await nc.jetstream().get_last_msg(subjects.EVENTS_STREAM, subjects.LEADER_EVENTS)
    return int(json.loads(msg.data or b"{}")["epoch"])
