"""A standby's warm fold (services/scheduler/warm_fold.py) over a real NATS stream: a
snapshot at any point plus the tail folds to exactly what a fold from sequence 1 gives, and
a snapshot it cannot trust (unreadable, of another stream) means a fold from sequence 1 with
one log line, never a crash."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS

from berth.services.scheduler.warm_fold import WarmFold
from berth.shared import nats_io, state_snapshot, subjects
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    AttemptReported,
    JobCancelRequested,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    Resources,
    TaskAssigned,
    WorkerDeclaredDead,
    WorkerRegistered,
    encode,
)
from berth.shared.states import TaskState

ROOT = Path(__file__).resolve().parent.parent


def mixed_history(seed: int, jobs: int) -> list[tuple[str, bytes]]:
    """(subject, event) in log order: workers coming and dying, jobs retried, cancelled,
    succeeding, and events the fold refuses or ignores (late or forged reports)."""
    rng = random.Random(seed)
    out: list[tuple[str, bytes]] = []

    def add(subject: str, event: msgspec.Struct) -> None:
        out.append((subject, encode(event)))

    add(subjects.LEADER_EVENTS, LeaderElected(scheduler_id="s1", epoch=1))
    workers = [f"w{n}" for n in range(4)]
    for w in workers:
        add(subjects.worker_events(w), WorkerRegistered(
            worker_id=w, incarnation="i1", resources=Resources(cpu=8, memory_mb=8000)))
    for seq in range(1, jobs + 1):
        job_id = f"j{seq}-{seq:04x}"
        replicas = rng.randint(1, 3)
        add(subjects.submit_outcome(None, seq), JobSubmitted(
            job_id=job_id, submit_seq=seq, spec=JobSpec(
                name=f"job{seq}", command=["x"], replicas=replicas,
                max_retries_failure=1,
                resources=Resources(cpu=1, memory_mb=100))))
        for index in range(replicas):
            for attempt in range(rng.randint(1, 2)):
                w = rng.choice(workers)
                add(subjects.task_events(job_id), TaskAssigned(
                    job_id=job_id, task_index=index, attempt_id=attempt, worker_id=w,
                    incarnation="i1", epoch=1))
                end = rng.choice([TaskState.SUCCEEDED, TaskState.FAILED, None])
                for state in [TaskState.RUNNING] + ([end] if end else []):
                    add(subjects.attempt_reports(w), AttemptReported(
                        job_id=job_id, task_index=index, attempt_id=attempt, worker_id=w,
                        state=state, exit_code=None if state == TaskState.RUNNING else
                        (0 if state == TaskState.SUCCEEDED else 3)))
        if rng.random() < 0.2:
            add(subjects.submit_outcome(None, seq), JobCancelRequested(
                job_id=job_id, submit_seq=seq, reason="enough"))
        if rng.random() < 0.1:
            # Forged: a report of another worker's attempt on this worker's subject.
            add(subjects.attempt_reports("w0"), AttemptReported(
                job_id=job_id, task_index=0, attempt_id=0, worker_id="w1",
                state=TaskState.SUCCEEDED, exit_code=0))
        if seq == jobs // 2:
            add(subjects.worker_verdicts("w3"), WorkerDeclaredDead(
                worker_id="w3", incarnation="i1", reason="silent", epoch=1))
    return out


async def publish(nc: NATS, events: list[tuple[str, bytes]]) -> int:
    for subject, data in events:
        await nc.publish(subject, data)
    await nc.flush()
    js = nc.jetstream()
    for _ in range(200):
        if (last := await nats_io.last_event_seq(js)) >= len(events):
            return last
        await asyncio.sleep(0.05)
    raise AssertionError("the stream did not take every event")


async def fold_from_one(nc: NATS, upto: int) -> ClusterState:
    state = ClusterState()
    events = nats_io.follow_events(nc.jetstream())
    try:
        async for record in events:
            state.apply(record.seq, record.event)
            if record.seq >= upto:
                return state
    finally:
        await events.aclose()
    raise AssertionError("the stream ended")


async def warm_up_to(nc: NATS, warm: WarmFold, last: int) -> ClusterState:
    """Stands `warm` by until it has folded `last`, then hands its fold over."""
    js = nc.jetstream()
    warm.stand_by(js)
    for _ in range(400):
        if warm.state.last_seq >= last:
            break
        await asyncio.sleep(0.025)
    return await warm.hand_over(js)


def same(a: ClusterState, b: ClusterState, stream: str) -> bool:
    return bool(msgspec.msgpack.decode(state_snapshot.dump(a, stream))
                == msgspec.msgpack.decode(state_snapshot.dump(b, stream)))


async def test_a_snapshot_at_any_point_plus_the_tail_equals_a_fold_from_one(
        nc: NATS, tmp_path: Path) -> None:
    js = nc.jetstream()
    last = await publish(nc, mixed_history(seed=18, jobs=25))
    fresh = await fold_from_one(nc, last)
    stream, _ = await nats_io.events_stream_identity(js)
    assert fresh.refused_events > 0 and len(fresh.jobs) == 25  # the history is not trivial
    rng = random.Random(5)
    for cut in [0, 1, last // 2, last - 1, last, rng.randrange(2, last - 1)]:
        path = tmp_path / f"cut{cut}" / "fold.snapshot"
        if cut:
            state_snapshot.write_atomically(path, state_snapshot.dump(
                await fold_from_one(nc, cut), stream))
        warm = WarmFold(path, 60.0)
        handed = await warm_up_to(nc, warm, last)
        assert handed.last_seq == last, cut
        assert same(handed, fresh, stream), f"snapshot at {cut} of {last}"
        # A term's fold is not taken back (it may be ahead of the log), and nothing empty
        # is saved over the snapshot file.
        warm.end_term()
        await warm.close()
        assert path.exists() == bool(cut)


@pytest.mark.parametrize("spoil", ["unreadable", "another stream"])
async def test_a_snapshot_it_cannot_trust_means_a_fold_from_one_and_one_line(
        nc: NATS, tmp_path: Path, caplog: pytest.LogCaptureFixture, spoil: str) -> None:
    js = nc.jetstream()
    path = tmp_path / "fold.snapshot"
    if spoil == "unreadable":
        path.write_bytes(b"not a snapshot")
    else:
        # A snapshot of a stream since deleted and made again, further along than it.
        await publish(nc, mixed_history(seed=1, jobs=6))
        stream, last = await nats_io.events_stream_identity(js)
        state_snapshot.write_atomically(path, state_snapshot.dump(
            await fold_from_one(nc, last), stream))
        await js.delete_stream(subjects.EVENTS_STREAM)
        await nats_io.ensure_streams(js)
    last = await publish(nc, mixed_history(seed=2, jobs=3))
    fresh = await fold_from_one(nc, last)
    stream, _ = await nats_io.events_stream_identity(js)
    with caplog.at_level(logging.WARNING, logger="berth.scheduler"):
        handed = await warm_up_to(nc, WarmFold(path, 60.0), last)
    assert same(handed, fresh, stream)
    lines = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(lines) == 1 and "folding from the first event" in lines[0], caplog.text
    assert ("unreadable" if spoil == "unreadable" else "folded from stream") in lines[0]


def test_the_takeover_bench_runs_and_a_warm_take_over_folds_only_its_own_election() -> None:
    """bench/takeover.py, small enough for CI (`--quick` is 20,000 events; this is one job of
    100 tasks): the numbers are
    the benchmark's to report; what is checked is that each take-over folded what it must."""
    done = subprocess.run([sys.executable, "bench/takeover.py", "--events", "400"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "BERTH_LEASE_TTL": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    # Everything up to its own leader_elected, which is the last event before the tail.
    assert report["cold_folded"] == report["events"] - report["tail_events"]
    assert report["warm_folded"] == 1  # its own leader_elected: the rest was warm
    assert report["cold_takeover_s"] > 0 and report["warm_takeover_s"] > 0
