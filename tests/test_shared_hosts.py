"""Ports belong to an address, not to a worker (docs/invariants.md, invariant 6): the
embedded stack's workers all run on 127.0.0.1, so a job's tasks there must get distinct
named ports."""

from __future__ import annotations

import sys

from nats.aio.client import Client as NATS

from berth.shared.messages import JobSpec, Resources
from berth.stack import Stack
from tests.conftest import run_doctor, wait_for_job
from tests.test_projection import accepted

# Binds its port (no SO_REUSEADDR: a port held by a sibling fails with EADDRINUSE) and holds
# it long enough for all four to overlap.
BIND = ("import os, socket, time; s = socket.socket(); "
        "s.bind(('127.0.0.1', int(os.environ['BERTH_PORT_HTTP']))); s.listen(); time.sleep(3)")


async def test_four_workers_on_one_address_give_four_distinct_ports(make_stack,
                                                                     nc: NATS) -> None:
    stack: Stack = make_stack(workers=4)
    spec = JobSpec(name="ports", command=[sys.executable, "-c", BIND], replicas=4,
                   ports=["http"], resources=Resources(cpu=0.5, memory_mb=16))
    job_id = await accepted(nc, spec)
    job = await wait_for_job(stack, job_id, {"succeeded", "failed"}, timeout=60)
    assert job["state"] == "succeeded", job
    attempts = [a for t in job["tasks"] for a in t["attempts"]]
    assert len(attempts) == 4  # nothing retried
    assert len({a["worker_id"] for a in attempts}) == 4  # spread over the four workers
    assert len({a["ports"]["http"] for a in attempts}) == 4

    assert "double_booked_ports=0" in await run_doctor(stack)
