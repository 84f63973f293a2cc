"""Every message berth publishes is bounded by construction (issue 21 item 6): lists that
grow with the cluster go out in chunks, free text is clipped, and a publish that can never
succeed is logged and dropped, never fatal."""

from __future__ import annotations

import logging

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client as NATS

from berth.shared import bounded, nats_io, subjects
from berth.shared.messages import (
    Constraint,
    JobSpec,
    Op,
    PendingReason,
    PendingReasonsChanged,
    Resources,
    encode,
)
from berth.stack import Stack
from tests.conftest import wait_for_job, wait_until
from tests.test_projection import accepted


@given(st.lists(st.integers(0, 300)), st.integers(1, 1000))
def test_chunks_keep_order_and_stay_under_the_bound(sizes: list[int], limit: int) -> None:
    parts = bounded.chunks(list(enumerate(sizes)), lambda item: item[1], limit)
    assert [item for part in parts for item in part] == list(enumerate(sizes))
    for part in parts:
        assert part
        assert sum(n for _, n in part) <= limit or len(part) == 1


def test_clip_bounds_text_and_says_how_much_was_cut() -> None:
    assert bounded.clip("short") == "short"
    clipped = bounded.clip("x" * 10_000, 100)
    assert clipped.startswith("x" * 100) and clipped.endswith("(9900 more characters)")


def test_100000_distinct_pending_reasons_go_out_in_messages_under_the_bound() -> None:
    from berth.services.scheduler.service import _encoded_size

    reasons = [PendingReason(f"j{i}-abcd", i % 10_000, f"no worker matches constraints: "
                             f"zone EQ nowhere-{i}") for i in range(100_000)]
    parts = bounded.chunks(reasons, _encoded_size)
    assert len(parts) > 1
    for part in parts:
        size = len(encode(PendingReasonsChanged(reasons=part, epoch=10**6, ts=1.0)))
        assert size <= bounded.MAX_MESSAGE_BYTES + 200  # the envelope around the list
    assert sum(len(p) for p in parts) == len(reasons)


async def test_a_message_over_the_payload_limit_is_dropped_not_raised(
        nc: NATS, caplog: pytest.LogCaptureFixture) -> None:
    js = nc.jetstream()
    await nats_io.ensure_streams(js)
    outgoing = [nats_io.Outgoing(subjects.PENDING_REASONS, b"x" * (2 * 1024 * 1024),
                                 nats_io.message_headers("too-big")),
                nats_io.Outgoing(subjects.PENDING_REASONS, b"{}",
                                 nats_io.message_headers("fine"))]
    with caplog.at_level(logging.ERROR, logger="berth.shared.nats_io"):
        seqs = await nats_io.publish_events(js, outgoing)
    assert seqs[0] == 0 and seqs[1] > 0
    assert "dropped a message to berth.events.pending (2097152 bytes)" in caplog.text


async def test_100000_pending_tasks_keep_the_scheduler_up(make_stack, nc: NATS) -> None:
    """Ten jobs of 10,000 tasks that no worker can take: one announcement of their 100,000
    pending reasons (~11 MB) was one message, over NATS's 1 MiB limit, and the scheduler
    died on MaxPayloadError. Chunked, every task shows its reason and work still runs."""
    stack: Stack = make_stack(workers=1, extra_env={"BERTH_PENDING_REASON_INTERVAL": "0.2"})
    small = Resources(cpu=0.1, memory_mb=16)
    waiting = [await accepted(nc, JobSpec(
        name=f"wait-{i}", command=["true"], replicas=10_000, resources=small,
        constraints=[Constraint(key="zone", op=Op.EQ, value=f"nowhere-{i}")]))
        for i in range(10)]

    def reasons_shown() -> bool:
        for job_id in (waiting[0], waiting[-1]):
            task = httpx.get(f"{stack.api_url}/api/jobs/{job_id}/tasks/9999", timeout=10).json()
            if not task["pending_reason"].startswith("no worker matches constraints: zone"):
                return False
        return True

    await wait_until(reasons_shown, 90, "the pending reasons of the last tasks")
    job_id = await accepted(nc, JobSpec(name="runs", command=["true"], resources=small))
    await wait_for_job(stack, job_id, {"succeeded"}, timeout=60)
    assert stack.children["scheduler"].poll() is None
    log = (stack.data_dir / "logs" / "scheduler.log").read_text()
    assert "MaxPayloadError" not in log and "dropped a message" not in log
