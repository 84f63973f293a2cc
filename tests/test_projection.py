"""The dashboard's projection: a durable consumer that resumes or re-reads exactly from where
the saved state stands, and a projection that, after retries, cancellations, a worker's
death and two restarts of the dashboard (one SIGKILL, one clean), equals a fresh fold of the
whole events stream."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from nats.aio.client import Client as NATS

from berth.client import cancel_job, publish_submit, wait_for_outcome
from berth.services.dashboard_api import timeline, views
from berth.services.dashboard_api.projection import Projection
from berth.shared import nats_io, servers, state_snapshot, subjects
from berth.shared.durable_feed import DurableEventFeed
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import JobSpec, JobSubmitted, LeaderElected, encode
from berth.stack import Stack, wait_for_api
from tests.conftest import get_json, run_doctor, wait_for_job, wait_until
from tests.test_gpu_pinning import berth
from tests.test_lifecycle_e2e import SMALL, accepted, long_task, pids_of, task


async def publish_events(nc: NATS, count: int, first_epoch: int = 1) -> None:
    js = nc.jetstream()
    for epoch in range(first_epoch, first_epoch + count):
        await nats_io.publish_event(js, "berth.events.leader",
                                    LeaderElected(scheduler_id="test", epoch=epoch),
                                    f"test-{epoch}")


async def take(feed: DurableEventFeed, after: int, count: int) -> list[int]:
    seqs: list[int] = []
    async for batch in feed.batches(after):
        seqs += [raw.seq for raw in batch]
        await feed.ack()
        if len(seqs) >= count:
            return seqs
    raise AssertionError("the feed ended")


async def test_durable_feed_resumes_where_it_stands_and_rereads_otherwise(nc: NATS) -> None:
    await publish_events(nc, 10)
    js = nc.jetstream()
    feed = DurableEventFeed(js, "test-feed", batch=4)
    assert await take(feed, 0, 10) == list(range(1, 11))
    assert not feed.resumed

    # Saved state at 10, the consumer acknowledged up to 10: bind to it as it stands.
    await publish_events(nc, 3, first_epoch=11)
    again = DurableEventFeed(js, "test-feed", batch=4)
    assert await take(again, 10, 3) == [11, 12, 13]
    assert again.resumed
    info = await js.consumer_info(subjects.EVENTS_STREAM, "test-feed")
    assert info.ack_floor.stream_seq == 13

    # Saved state older than the consumer (a crash before the snapshot): read again.
    older = DurableEventFeed(js, "test-feed", batch=4)
    assert await take(older, 5, 8) == list(range(6, 14))
    assert not older.resumed


async def test_a_paced_feed_takes_a_lone_event_at_once_and_a_burst_in_one_batch(
        nc: NATS) -> None:
    await publish_events(nc, 1)
    feed = DurableEventFeed(nc.jetstream(), "paced-feed", batch=100, pace=3.0)
    batches = feed.batches(0)
    assert [raw.seq for raw in await anext(batches)] == [1]

    # After a quiet spell longer than the pace, a lone event is not held back.
    await asyncio.sleep(3.0)
    took = time.monotonic()
    await publish_events(nc, 1, first_epoch=2)
    assert [raw.seq for raw in await anext(batches)] == [2]
    assert time.monotonic() - took < 1.5

    # Events arriving one by one right after it wait out the pace and come as one batch
    # (unpaced, the fetch would return the first of them alone).
    async def trickle() -> None:
        for epoch in range(3, 8):
            await publish_events(nc, 1, first_epoch=epoch)
            await asyncio.sleep(0.05)

    trickling = asyncio.create_task(trickle())
    assert [raw.seq for raw in await anext(batches)] == [3, 4, 5, 6, 7]
    await trickling
    await batches.aclose()


async def folded_stream(nc: NATS, upto: int) -> ClusterState:
    state = ClusterState()
    async for record in nats_io.follow_events(nc.jetstream()):
        state.apply(record.seq, record.event)
        if record.seq >= upto:
            return state
    raise AssertionError("the stream ended")


def restart_dashboard(stack: Stack) -> None:
    stack.start_service("dashboard")
    wait_for_api(stack)


def as_json(value: msgspec.Struct) -> Any:
    return json.loads(msgspec.json.encode(value))


async def test_projection_equals_a_fresh_rebuild_after_retries_cancels_deaths_and_restarts(
        make_stack: Any, nc: NATS, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=2, extra_env={"BERTH_SNAPSHOT_INTERVAL": "0.3"})
    await wait_until(lambda: len(get_json(stack, "/api/workers")) == 2, what="2 workers")
    flaky = await accepted(nc, JobSpec(
        name="flaky", max_retries_failure=2, resources=SMALL, command=[
            "python3", "-c",
            "import os, sys; sys.exit(0 if int(os.environ['BERTH_ATTEMPT_ID']) >= 2 else 7)"]))
    survivor = await accepted(nc, long_task(tmp_path / "survivor",
                                            env={"FINISH_ATTEMPTS": "1,2,3"}))
    doomed = await accepted(nc, long_task(tmp_path / "doomed", name="doomed"))
    await pids_of(tmp_path / "survivor")
    await pids_of(tmp_path / "doomed")
    await wait_for_job(stack, flaky, {"succeeded"})

    # 1. The dashboard is SIGKILLed: it restarts from its last snapshot and the stream.
    stack.children.pop("dashboard").send_signal(signal.SIGKILL)
    restart_dashboard(stack)

    # 2. The survivor's worker dies: its task fails over to the other worker.
    victim = task(get_json(stack, f"/api/jobs/{survivor}"))["attempts"][0]["worker_id"]
    stack.children.pop(victim).send_signal(signal.SIGKILL)
    await wait_for_job(stack, survivor, {"succeeded"}, timeout=40)

    # 3. The dashboard stops cleanly; a cancel happens while it is down; it comes back.
    stack.stop_child("dashboard")
    assert (await cancel_job(nc, doomed, reason="enough")).accepted
    restart_dashboard(stack)
    await wait_for_job(stack, doomed, {"killed"})
    log = (stack.data_dir / "logs" / "dashboard.log").read_text()
    assert re.search(r"events consumer berth-dashboard-[0-9a-f]{8} resumed after sequence", log)

    js = nc.jetstream()
    await wait_until(lambda: task(get_json(stack, f"/api/jobs/{doomed}"))["attempts"][0]
                     ["exited"], what="the cancelled task's exit")
    last = await nats_io.last_event_seq(js)
    await wait_until(lambda: get_json(stack, "/healthz")["events_seq"] == last,
                     what="the dashboard to catch up")
    fresh = await folded_stream(nc, last)

    # Every job as the API shows it (to an admin: env values and all) equals the same view
    # of a fresh fold from sequence 1.
    assert set(fresh.jobs) == {flaky, survivor, doomed}
    admin = {"Authorization": f"Bearer {stack.api_token}"}
    for job_id, job in fresh.jobs.items():
        shown = httpx.get(f"{stack.api_url}/api/jobs/{job_id}", headers=admin, timeout=10)
        assert shown.json() == as_json(views.job_detail(job))
    flaky_task = fresh.jobs[flaky].tasks[0]
    assert flaky_task.failure_count == 2 and len(flaky_task.attempts) == 3
    survivor_task = fresh.jobs[survivor].tasks[0]
    assert [a.state.display for a in survivor_task.attempts] == ["worker_failed", "succeeded"]
    shown = {w["worker_id"]: w for w in get_json(stack, "/api/workers")}
    for worker_id, worker in fresh.workers.items():
        expected = as_json(views.worker_out(worker, None, False))
        for live_only in ("healthy", "last_heartbeat"):
            del expected[live_only], shown[worker_id][live_only]
        assert shown[worker_id] == expected

    # So is its host timeline, its index rebuilt from a snapshot and extended as it folds.
    until = time.time() + 60
    rows, *_ = timeline.host_page(fresh, timeline.build_index(fresh), 0, until, None, 100, None)
    assert get_json(stack, f"/api/timeline?since=0&until={until}")["hosts"] == [
        as_json(r) for r in rows]
    assert sum(len(r.bars) for r in rows) == sum(
        len(t.attempts) for j in fresh.jobs.values() for t in j.tasks)

    # Its saved state, written as it stopped, is the fresh fold exactly.
    stack.stop_child("dashboard")
    saved = (stack.data_dir / "dashboard" / "projection.snapshot").read_bytes()
    stream, _ = await nats_io.events_stream_identity(js)
    assert state_snapshot.load(saved, stream, last).last_seq == last
    assert msgspec.msgpack.decode(saved) == msgspec.msgpack.decode(
        state_snapshot.dump(fresh, stream))

    await compacted_out_of_the_stream(stack, nc, {flaky, survivor, doomed})


async def compacted_out_of_the_stream(stack: Stack, nc: NATS, job_ids: set[str]) -> None:
    """Every job has finished: `berth admin compact --older-than 0s` takes them out of the
    stream (docs/retention.md); a dashboard folding it from sequence 1 never sees them, and
    the checker reads no violation."""
    js = nc.jetstream()
    before = (await js.stream_info(subjects.EVENTS_STREAM)).state
    out = await berth(stack, "admin", "compact", "--older-than", "0s")
    assert out.startswith(f"compacted {len(job_ids)} jobs finished more than 0s ago"), out
    after = (await js.stream_info(subjects.EVENTS_STREAM)).state
    assert after.messages < before.messages / 2 and after.bytes < before.bytes / 2, (
        before, after)
    last = await nats_io.last_event_seq(js)
    fresh = await folded_stream(nc, last)
    assert fresh.jobs == {} and fresh.pending == {} and fresh.compacted_jobs == len(job_ids)
    assert all(w.live_attempts == {} for w in fresh.workers.values())

    # `berth doctor` folds it from sequence 1 too (as a scheduler without its snapshot
    # does; tests/test_retention.py folds the orders a replay can meet), meanwhile.
    doctor = asyncio.create_task(run_doctor(stack))
    await asyncio.sleep(0)
    # The dashboard, its snapshot gone, folds the stream from sequence 1: the purged gaps
    # are known for what they are, never read again nor reported missing.
    (stack.data_dir / "dashboard" / "projection.snapshot").unlink()
    log_path = stack.data_dir / "logs" / "dashboard.log"
    logged = len(log_path.read_text().splitlines())
    restart_dashboard(stack)
    await wait_until(lambda: get_json(stack, "/healthz")["events_seq"] >= last,
                     what="the dashboard to catch up")
    since = log_path.read_text().splitlines()[logged:]
    assert [line for line in since if "events consumer" in line or "not in the stream" in line
            ] == [next(line for line in since if "events consumer" in line)], since
    assert get_json(stack, "/api/jobs")["jobs"] == []
    gone = httpx.get(f"{stack.api_url}/api/jobs/{min(job_ids)}", timeout=10)
    assert gone.status_code == 404 and "compacted" in gone.text

    assert "violations=0" in (out := await doctor), out


async def test_a_snapshot_of_another_events_stream_is_thrown_away(
        nc: NATS, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The events stream was made again (its store removed by hand, say): the dashboard's
    snapshot of the old one must not be continued, or it would show the old jobs and never
    the new ones (it would wait for sequences past the old stream's end)."""
    js = nc.jetstream()
    await nats_io.ensure_streams(js)

    async def submitted(job_id: str, submit_seq: int) -> None:
        await nats_io.publish_event(js, subjects.submit_outcome(None, submit_seq), JobSubmitted(
            job_id=job_id, submit_seq=submit_seq,
            spec=JobSpec(name=job_id, command=["true"], resources=SMALL)), f"{job_id}-test")

    for n in range(1, 4):
        await submitted(f"j{n}-old", n)
    path = tmp_path / "dashboard" / "projection.snapshot"
    first = Projection(nc, 5.0, snapshot_path=path)
    await first.start()
    await asyncio.wait_for(first.caught_up.wait(), 30)
    await first.stop()
    assert path.exists() and len(first.state.jobs) == 3

    await js.delete_stream(subjects.EVENTS_STREAM)
    await nats_io.ensure_streams(js)
    await submitted("j1-new", 1)
    with caplog.at_level(logging.WARNING, logger="berth.dashboard.projection"):
        second = Projection(nc, 5.0, snapshot_path=path)
        await second.start()
        try:
            await asyncio.wait_for(second.caught_up.wait(), 30)
            assert set(second.state.jobs) == {"j1-new"}
        finally:
            await second.stop()
    assert any("not used (it was folded from stream BERTH_EVENTS@" in r.getMessage()
               for r in caplog.records), caplog.text
    # The snapshot saved now is of the new stream, and is used by the next start.
    third = Projection(nc, 5.0, snapshot_path=path)
    await third.start()
    try:
        assert set(third.state.jobs) == {"j1-new"} and third.caught_up.is_set()
    finally:
        await third.stop()


async def test_an_unreadable_snapshot_means_a_rebuild_not_a_crash(
        make_stack: Any, nc: NATS) -> None:
    stack: Stack = make_stack(workers=1)
    job_id = await accepted(nc, JobSpec(name="ok", command=["true"], resources=SMALL))
    await wait_for_job(stack, job_id, {"succeeded"})
    stack.stop_child("dashboard")
    snapshot = stack.data_dir / "dashboard" / "projection.snapshot"
    snapshot.write_bytes(b"not a snapshot")
    restart_dashboard(stack)
    job = await wait_for_job(stack, job_id, {"succeeded"})
    assert job["task_counts"] == {"succeeded": 1}
    log = (stack.data_dir / "logs" / "dashboard.log").read_text()
    assert "not used (unreadable" in log and "rebuilding from the first event" in log
    # A later message on the stream is still folded.
    await nc.jetstream().publish(subjects.SUBMIT_JOB, encode(JobSpec(
        name="after", command=["true"], resources=SMALL)), stream=subjects.SUBMIT_STREAM)
    await wait_until(lambda: len(get_json(stack, "/api/jobs")["jobs"]) == 2,
                     what="the next job")


async def test_two_dashboards_following_a_burst_each_equal_the_fold(
        make_stack: Any, nc: NATS, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=2)
    port = servers.free_port()
    second_url = f"http://127.0.0.1:{port}"
    stack.start_service("dashboard", label="dashboard-2", env={
        "BERTH_DATA_DIR": str(tmp_path / "second"), "BERTH_API_PORT": str(port)})
    await wait_until(lambda: _answers(second_url), what="the second dashboard")
    seqs = [await publish_submit(nc, encode(JobSpec(name=f"b{i}", command=["true"],
                                                    resources=SMALL))) for i in range(40)]
    jobs = [str((await wait_for_outcome(nc, seq)).job_id) for seq in seqs]
    for job_id in jobs:
        await wait_for_job(stack, job_id, {"succeeded"}, timeout=120)
    last = await nats_io.last_event_seq(nc.jetstream())
    for url in (stack.api_url, second_url):
        await wait_until(lambda u=url: httpx.get(u + "/healthz").json()["events_seq"] == last,
                         what=f"{url} to catch up")
    fresh = await folded_stream(nc, last)
    for job_id in jobs:
        expected = as_json(views.job_detail(fresh.jobs[job_id]))
        for url in (stack.api_url, second_url):
            assert httpx.get(f"{url}/api/jobs/{job_id}").json() == expected
    consumers = [c.name for c in await nc.jetstream().consumers_info(subjects.EVENTS_STREAM)]
    assert len([c for c in consumers if c.startswith("berth-dashboard-")]) == 2


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


async def test_fold_to_head_waits_for_what_the_stream_holds_and_no_longer(
        nc: NATS, tmp_path: Path) -> None:
    """What the API waits on before it says 404 for a job a client was just told of
    (docs/dashboard.md): the fold reaching the stream's head as of the call, bounded."""
    await publish_events(nc, 3)
    idle = Projection(nc, 5.0, snapshot_path=tmp_path / "idle" / "projection.snapshot")
    started = time.monotonic()
    await idle.fold_to_head(0.3)  # nothing folds (not started): it gives up in time
    assert 0.25 <= time.monotonic() - started < 2 and idle.state.last_seq == 0
    live = Projection(nc, 5.0, snapshot_path=tmp_path / "live" / "projection.snapshot")
    await live.start()
    try:
        await asyncio.wait_for(live.caught_up.wait(), 30)
        for burst in range(3):
            await publish_events(nc, 50, first_epoch=10 + 50 * burst)
            head = (await nc.jetstream().stream_info(subjects.EVENTS_STREAM)).state.last_seq
            await live.fold_to_head(5)
            assert live.state.last_seq == head
    finally:
        await live.stop()
