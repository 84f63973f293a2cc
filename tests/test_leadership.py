"""Taking over as leader on a long log, with real services."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS

from berth.client import submit_job
from berth.shared import nats_io, subjects
from berth.shared.messages import JobSpec, PendingReasonsChanged, Resources, encode
from berth.stack import Stack
from tests.conftest import wait_for_job, wait_until

FILLER = 40_000


async def test_a_take_over_longer_than_the_lease_keeps_the_lease(make_stack, nc: NATS) -> None:
    # Folding 40,000 events takes the new leader seconds: far longer than a 0.5 s lease.
    # Before the lease was kept during the take-over, the lease expired mid-fold, was won
    # again at a new epoch, and the scheduler stood down and began again, forever.
    filler = encode(PendingReasonsChanged(reasons=[], epoch=0))
    for start in range(0, FILLER, 5000):
        await nats_io.publish_events(nc.jetstream(), [
            nats_io.Outgoing(subjects.PENDING_REASONS, filler,
                             nats_io.message_headers(f"filler:{i}"))
            for i in range(start, start + 5000)])
    stack: Stack = make_stack(workers=1, extra_env={"BERTH_LEASE_TTL": "0.5"})
    log = stack.data_dir / "logs" / "scheduler.log"
    await wait_until(lambda: "leading with epoch" in log.read_text(), timeout=60,
                     what="the scheduler to lead")
    await asyncio.sleep(1.5)  # three lease lifetimes: a lease lost in the take-over shows
    outcome = await submit_job(nc, JobSpec(name="after", command=["true"],
                                           resources=Resources(cpu=0.5, memory_mb=64)))
    assert outcome.accepted, outcome.reason
    await wait_for_job(stack, str(outcome.job_id), {"succeeded"}, timeout=60)
    text = log.read_text()
    assert "lost leadership" not in text, text[-2000:]
    assert text.count("leading with epoch") == 1
