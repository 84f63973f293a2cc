"""Redis going away does not take berth with it: a scheduler that loses Redis stands down and
comes back when Redis does, and a Sentinel failover in the middle of a burst loses no job,
double-books no host and gives no epoch to two leaders. Real valkey, Sentinel, nats-server
and berth services, all on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import redis as sync_redis
from nats.aio.client import Client as NATS
from redis.asyncio.sentinel import MasterNotFoundError

from berth.client import publish_submit, submit_job, wait_for_outcome
from berth.shared import nats_io, redis_auth, redis_io, servers, subjects
from berth.shared.checker import Report, check_cluster
from berth.shared.messages import JobSpec, LeaderElected, Resources, encode
from berth.shared.reservations import ReservationStore
from berth.stack import Stack
from tests.conftest import get_json, wait_for_job, wait_until

TINY = Resources(cpu=0.1, memory_mb=16)


def log_of(stack: Stack, label: str) -> str:
    return (stack.data_dir / "logs" / f"{label}.log").read_text()


async def leader_epochs(nc: NATS) -> list[int]:
    msgs = await nats_io.read_subject(nc.jetstream(), subjects.EVENTS_STREAM,
                                      subjects.LEADER_EVENTS)
    events = [nats_io.raw_event(m).record().event for m in msgs]
    return [e.epoch for e in events if isinstance(e, LeaderElected)]


async def test_a_redis_outage_does_not_kill_the_scheduler(make_stack, nc: NATS,
                                                          tmp_path: Path) -> None:
    redis = servers.start_redis(tmp_path / "own-redis")
    try:
        stack: Stack = make_stack(workers=1, redis=redis)
        await wait_until(lambda: "leading with epoch" in log_of(stack, "scheduler"),
                         what="a leader")
        os.kill(redis.proc.pid, signal.SIGKILL)
        redis.proc.wait()
        await wait_until(lambda: "retrying" in log_of(stack, "scheduler"),
                         what="the scheduler to notice")
        await asyncio.sleep(3)  # a dozen retries or so
        assert stack.children["scheduler"].poll() is None
        text = log_of(stack, "scheduler")
        assert "Traceback" not in text, text[-3000:]
        assert text.count("unavailable") == 1, text[-3000:]  # not a line per retry
        # The same server back on its port, with its data (AOF) and passwords.
        redis = servers.start_redis(tmp_path / "own-redis", port=redis.port)
        outcome = await submit_job(nc, JobSpec(name="after", command=["true"], resources=TINY))
        await wait_for_job(stack, str(outcome.job_id), {"succeeded"})
        text = log_of(stack, "scheduler")
        assert "Redis available again" in text and "Traceback" not in text
        epochs = await leader_epochs(nc)
        assert len(epochs) == 2 and len(set(epochs)) == 2, epochs
    finally:
        redis.stop()


BURST = 80  # enough to be mid-burst at the kill (a fifth done), few enough for CI
# Each burst job sleeps a little and takes a quarter of a worker's two CPUs, so no more than
# 8 run at once and the burst lasts at least ten rounds of 0.3 s. With TINY's 0.1 CPU all 80
# fitted in two rounds, and CI once saw every job done before the kill (80 < 80).
BURST_JOB = Resources(cpu=0.5, memory_mb=16)


SCHEDULERS = ("scheduler", "scheduler-2")


def wait_calls(node: servers.RedisServer) -> int:
    """How many WAITs `node` has run since it started."""
    with sync_redis.Redis.from_url(node.url_for(redis_auth.ADMIN)) as admin:
        stats = admin.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


def succeeded(stack: Stack) -> int:
    page = get_json(stack, "/api/jobs?state=succeeded&name_prefix=burst-&limit=1000")
    return len(page["jobs"])


async def check_after_failover(nc: NATS, cluster: servers.ReplicatedRedis) -> Report:
    """The checker's report, read through Sentinel. Its Sentinels may still answer "no
    master" for a moment after the promotion (seen once in CI, with every job done), so a
    MasterNotFoundError is asked again, for up to 30 s."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        doctor = redis_io.open_client(cluster.settings_for(redis_auth.DOCTOR))
        try:
            return await check_cluster(nc.jetstream(), ReservationStore(doctor), settle=0.5)
        except MasterNotFoundError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.5)
        finally:
            await doctor.aclose()


async def test_a_sentinel_failover_mid_burst_loses_nothing(make_stack, nc: NATS,
                                                          tmp_path: Path) -> None:
    # Two replicas: after the primary dies, the promoted one still has a replica to
    # acknowledge the leader's writes (with one, placement waits for a replica to return).
    cluster = servers.start_replicated_redis(tmp_path / "redis-ha", replicas=2)
    try:
        stack: Stack = make_stack(workers=2, redis=cluster, worker_cpu=2)
        stack.start_service("scheduler", label="scheduler-2")
        await wait_until(lambda: all("started; waiting" in log_of(stack, s)
                                     for s in SCHEDULERS),
                         what="both schedulers up")
        await wait_until(lambda: any("leading with epoch" in log_of(stack, s)
                                     for s in SCHEDULERS), what="a leader")
        seqs = [await publish_submit(nc, encode(JobSpec(
            name=f"burst-{i}", command=["sleep", "0.3"], resources=BURST_JOB)))
            for i in range(BURST)]
        await wait_until(lambda: succeeded(stack) >= BURST // 5, timeout=60,
                         what="a fifth of the burst")
        old = cluster.primary()
        # What each scheduler had logged before the kill: the leader to wait for below is
        # one that leads after it (a term handed over earlier, under load, does not count).
        logged_before = {s: len(log_of(stack, s)) for s in SCHEDULERS}
        os.kill(old.proc.pid, signal.SIGKILL)
        done_at_kill = succeeded(stack)
        await wait_until(lambda: cluster.primary() is not old, timeout=30,
                         what="Sentinel to promote a replica")
        outcomes = [await wait_for_outcome(nc, seq) for seq in seqs]
        assert all(o.accepted for o in outcomes)
        await wait_until(lambda: succeeded(stack) == BURST, timeout=120,
                         what=f"all {BURST} jobs to succeed")
        assert done_at_kill < BURST, "the failover came after the burst"
        # Every job ended, and succeeded: none is anything but succeeded.
        everything = get_json(stack, "/api/jobs?name_prefix=burst-&limit=1000")["jobs"]
        assert {j["state"] for j in everything} == {"succeeded"}

        # The failover cost the leader its term, and the attempts that ended since then
        # hold reservations until the next leader's take-over lets go of them (its
        # reconcile, logged before "leading with epoch N"). The check is of the cluster as
        # that leader leaves it: read sooner, those reservations show as owed releases
        # (seen once in five runs, with the last jobs done 3 s after the kill).
        await wait_until(lambda: any("leading with epoch" in log_of(stack, s)[n:]
                                     for s, n in logged_before.items()),
                         timeout=60, what="a leader after the failover")
        report = await check_after_failover(nc, cluster)
        assert report.violations() == [] and report.double_booked_hosts == 0, report

        epochs = await leader_epochs(nc)
        assert len(epochs) >= 2 and len(set(epochs)) == len(epochs), epochs
        # The leader's writes on the new primary waited for its replica.
        new = cluster.primary()
        assert wait_calls(new) > 0, {
            node.port: wait_calls(node) if node.proc.poll() is None else "down"
            for node in cluster.nodes} | {"primary": new.port, "old": old.port}
        for label, proc in stack.children.items():
            assert proc.poll() is None, f"{label} exited with {proc.returncode}"
        for label in SCHEDULERS:
            assert "Traceback" not in log_of(stack, label), log_of(stack, label)[-3000:]
    finally:
        cluster.stop()
