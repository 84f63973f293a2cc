"""A leader that cannot reach NATS is no leader: cut off from NATS (but not from Redis) it
stops renewing its lease, the standby takes over and places work, and no worker is declared
dead on the word of a leader that could not hear it. The cut is a relay on loopback that
holds every byte back (the connection stays open, as over a real partition), so this runs
without root; tests/test_partitions.py does the same across network namespaces."""

from __future__ import annotations

import asyncio
import json
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from berth.shared import subjects
from berth.shared.messages import JobSpec, Resources
from berth.stack import Stack
from tests import netbed
from tests.conftest import get_json, wait_for_job, wait_until
from tests.test_projection import accepted

SMALL = Resources(cpu=0.1, memory_mb=16)


async def test_a_leader_cut_off_from_nats_gives_up_its_lease(make_stack, nc: NATS) -> None:
    stack: Stack = make_stack(workers=2, extra_env={"BERTH_LEASE_TTL": "2"})
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2, what="2 workers")
    # The stack's own scheduler makes way for one whose NATS connection runs through a relay.
    stack.stop_child("scheduler")
    relay = netbed.relay(stack.nats.port)
    try:
        leader = stack.start_service(
            "scheduler", label="scheduler-a",
            env={"BERTH_NATS_URL": f"nats://127.0.0.1:{relay.port}"})
        first = await accepted(nc, JobSpec(name="first", command=["true"], resources=SMALL))
        await wait_for_job(stack, first, {"succeeded"})
        # (The stack's scheduler only ever led, so it saved no snapshot: a term's fold may be
        # ahead of the log, warm_fold.end_term. Snapshots are tested in test_warm_fold.)
        stack.start_service("scheduler", label="scheduler-b")
        old_epoch = await _current_epoch(nc)

        elected: list[tuple[float, int]] = []
        deaths: list[str] = []

        async def on_elected(msg: Msg) -> None:
            elected.append((time.monotonic(), int(json.loads(msg.data)["epoch"])))

        async def on_death(msg: Msg) -> None:
            deaths.append(json.loads(msg.data)["worker_id"])

        subs = [await nc.subscribe(subjects.LEADER_EVENTS, cb=on_elected),
                await nc.subscribe(subjects.worker_verdicts("*"), cb=on_death)]
        relay.cut()
        cut_at = time.monotonic()
        during = await accepted(nc, JobSpec(name="during", command=["true"], resources=SMALL))
        await wait_for_job(stack, during, {"succeeded"}, timeout=20)
        took_over = [t - cut_at for t, epoch in elected if epoch > old_epoch]
        assert took_over, "the standby never took over"
        # Its lease lapses within a TTL of the last answer from NATS, and the standby
        # polls every TTL/3 (TTL 2 s here); slack for a loaded machine.
        assert took_over[0] < 8, took_over
        # Healed once the cut has lasted twice BERTH_WORKER_DEAD_AFTER (3 s in these tests),
        # counted from the cut, not from the job's end: a leader that went on deciding while
        # cut off would have declared the workers dead by then.
        dead_after = float(stack.env["BERTH_WORKER_DEAD_AFTER"])
        await asyncio.sleep(max(0.0, cut_at + 2 * dead_after - time.monotonic()))
        relay.heal()
        # What the cut-off leader held back reaches the server as soon as the relay lets it
        # through (a connection NATS dropped meanwhile is made again within 0.5 s).
        await asyncio.sleep(2)
        for sub in subs:
            await sub.unsubscribe()
        assert deaths == [], f"workers declared dead during or after the cut: {deaths}"
        assert leader.poll() is None  # it stands by; it did not die
        log = (stack.data_dir / "logs" / "scheduler-a.log").read_text()
        assert "NATS has not answered" in log
    finally:
        relay.close()


async def _current_epoch(nc: NATS) -> int:
    msg = await nc.jetstream().get_last_msg(subjects.EVENTS_STREAM, subjects.LEADER_EVENTS)
    return int(json.loads(msg.data or b"{}")["epoch"])
