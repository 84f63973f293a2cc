"""Scale benchmark: the real control plane (nats-server, valkey, submitter, scheduler,
dashboard) against simulated hosts (`berth run worker --simulate N`), measured the way
kube-scheduler's scheduler_perf, Armada's fake executor and Volcano's KWOK runs measure.

    .venv/bin/python bench/scale.py            # W1-W5 at full size (many minutes)
    .venv/bin/python bench/scale.py --quick    # a small version of each, about a minute
    .venv/bin/python bench/scale.py --only W2,W3
    .venv/bin/python bench/scale.py --only W1 --nats-nodes 3   # NATS as 3 nodes, R3 streams

Workloads (each on a fresh stack):
  W1 throughput  hosts x 4 cpu; single-task 1-cpu jobs submitted as fast as the client can:
                 placements/s (submit -> ASSIGNED), completions/s, p50/p99 submit->ASSIGNED
                 and submit->RUNNING, scheduler peak RSS.
  W2 gangs       64 hosts in 8 slices of 8; 200 coscheduled 8-task jobs submitted at once:
                 time to place all, gang placements/s, the checker's (`berth doctor`) result.
  W8 gang burst  W2 with a slice for every gang (200 slices of 8, 1,600 hosts): all fit at
                 once, so the time to place them all is the scheduler's gang placement rate.
  W3 latency     an idle cluster; 200 single-task jobs one after another: submit->RUNNING.
  W4 growth      W1 at 1,000, 5,000 and 10,000 hosts, tasks = 20 x the largest size at
                 every size (capped by time): how the rate holds as the cluster grows.
  P1 processes   real worker agents (8 x 8 cpu) running real processes: 500 `true` jobs at
                 once: jobs/s, submit->SUCCEEDED percentiles, CPU seconds per job across
                 every process of the stack, and what the whole machine spent per job
                 (which counts the short-lived supervisors and tasks the former miss).
  W6 queue       1,000 hosts x 4 cpu filled with hour-long 1-cpu tasks and 36,000 more
                 waiting: each process's CPU per second once the queue stands (nothing can
                 be placed until a task ends, so a scheduler should cost what it does idle).
  W7 churn       W6 with tasks of 5-15 s: every freed slot is refilled from the queue;
                 each process's CPU per second, placements/s and CPU per placement.
  W5 preemption  1,000 hosts in slices of 8, full of batch gangs; 100 production gangs of 8
                 arrive at once: time until all run, evictions/s, how long each waited
                 after its last victim exited (simulated victims exit at once: the grace
                 ends there), the checker's result.

Prints one JSON line per workload on stdout, then a table on stderr. Times are the events'
own timestamps (every process is on this machine's clock) against the client's publish
time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from procstat import (  # bench/procstat.py
    cpu_by_process,
    cpu_seconds,
    cpu_used,
    machine_busy_seconds,
    own_cpu_seconds,
    status_mib,
)
from sigterm import tear_down_on_sigterm  # bench/sigterm.py

from berth.client import publish_submits
from berth.shared import nats_io, redis_auth, redis_io, redis_keys
from berth.shared.checker import check_cluster
from berth.shared.messages import (
    Coscheduling,
    JobSpec,
    JobSubmitted,
    Priority,
    Resources,
    SubmitRejected,
    TasksPreempted,
    TpuDevice,
    WorkerRegistered,
    assignments_in,
    attempt_key,
    encode,
    reports_in,
)
from berth.shared.reservations import ReservationStore
from berth.shared.states import TaskState
from berth.stack import Stack, start_stack

TPU = TpuDevice(variant="v5p", topology="2x2x1", count=4)


@dataclass
class Observed:
    """What the events stream says about the submitted jobs, folded as it arrives."""

    submitted_at: dict[int, float] = field(default_factory=dict)  # submit seq -> publish time
    job_seq: dict[str, int] = field(default_factory=dict)  # job id -> submit seq
    assigned: dict[tuple[str, int], float] = field(default_factory=dict)  # first assignment
    worker_of: dict[tuple[str, int], str] = field(default_factory=dict)  # its worker
    running: dict[tuple[str, int], float] = field(default_factory=dict)
    finished: dict[tuple[str, int], float] = field(default_factory=dict)
    group_of: dict[str, str] = field(default_factory=dict)  # gang job id -> its group
    rejected: int = 0
    failed: int = 0  # attempts that ended other than SUCCEEDED
    registered: set[str] = field(default_factory=set)  # worker ids
    # Preemptions: (when, preemptor, victim attempt keys); attempt key -> when it exited.
    preemptions: list[tuple[float, str, list[str]]] = field(default_factory=list)
    exits: dict[str, float] = field(default_factory=dict)
    # CPU seconds the attempts' own process trees used, as their exit reports say
    # (measured by each supervisor from its reaped children: exact).
    task_cpu_s: float = 0.0
    last_seq: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def latencies(self, stamps: dict[tuple[str, int], float]) -> list[float]:
        out = []
        for (job_id, _), ts in stamps.items():
            sent = self.submitted_at.get(self.job_seq.get(job_id, -1))
            if sent is not None:
                out.append(max(0.0, ts - sent))
        return out


async def observe(nc: NATS, seen: Observed, start_seq: int = 1) -> None:
    async for record in nats_io.follow_events(nc.jetstream(), start_seq):
        event = record.event
        seen.last_seq = record.seq
        if isinstance(event, WorkerRegistered):
            seen.registered.add(event.worker_id)
        elif isinstance(event, JobSubmitted):
            seen.job_seq[event.job_id] = event.submit_seq
        elif isinstance(event, SubmitRejected):
            seen.rejected += 1
        elif isinstance(event, TasksPreempted):
            seen.preemptions.append((event.ts, event.job_id, event.victims))
        for assigned in assignments_in(event):
            seen.assigned.setdefault((assigned.job_id, assigned.task_index), assigned.ts)
            seen.worker_of.setdefault((assigned.job_id, assigned.task_index),
                                      assigned.worker_id)
            if assigned.group:
                seen.group_of.setdefault(assigned.job_id, assigned.group)
        for report in reports_in(event):
            key = (report.job_id, report.task_index)
            if report.state == TaskState.RUNNING:
                seen.running.setdefault(key, report.ts)
            elif report.state in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.KILLED):
                seen.finished[key] = report.ts
                seen.failed += report.state != TaskState.SUCCEEDED
                if report.usage is not None:
                    seen.task_cpu_s += report.usage.cpu_seconds
                seen.exits[attempt_key(report.job_id, report.task_index,
                                       report.attempt_id)] = report.ts
        seen.changed.set()


async def wait_for(seen: Observed, done: Any, timeout: float, what: str) -> bool:
    """Waits until `done()`; False (and a note on stderr) if `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"  {what}: stopped waiting after {timeout:.0f} s", file=sys.stderr)
            return False
        seen.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.changed.wait(), min(left, 1.0))
    return True


async def submit_all(nc: NATS, seen: Observed, specs: list[bytes], window: int = 256,
                     rate: float | None = None) -> float:
    """Publishes as fast as JetStream acknowledges, `window` in flight, or at `rate` jobs/s
    (in 10 ms steps); returns the offered rate (jobs/s). Each window or step goes out as a
    client's sweep does (berth.client.publish_submits), read by berth's NATS client, which
    spends less of the cores the cluster runs on."""
    t0 = time.time()

    async def some(payloads: list[bytes]) -> None:
        sent = time.time()
        for seq in await publish_submits(nc, payloads):
            seen.submitted_at[seq] = sent

    step = window if rate is None else max(1, round(rate / 100))
    in_flight: set[asyncio.Task[None]] = set()
    for start in range(0, len(specs), step):
        if rate is None:
            await some(specs[start:start + step])
            continue
        # Paced: never wait for acks before the next step is due.
        await asyncio.sleep(max(0.0, t0 + start / rate - time.time()))
        task = asyncio.create_task(some(specs[start:start + step]))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)
    return len(specs) / max(time.time() - t0, 1e-9)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(len(ordered) * q))], 1)


SIM_LABEL = re.compile(r"^sim[0-9]*$")
TEARDOWN_WAIT = 10.0
# A timed workload may have ended once the events stream has not grown for this long
# (`Cluster.when_quiet`): then the benchmark reads the stream, and a run still going (a gap
# this long while work is under way, such as one long task) is followed live to its end.
STREAM_QUIET = 1.0
STREAM_POLL = 0.1
Snap = TypeVar("Snap")


def sim_processes(cpus: int | None = None) -> int:
    """How many processes host the simulated hosts: one on up to 7 cores, then one per 4
    cores, at most 4. On a many-core machine one process of 1,000 hosts, which does every
    host's share of each job (its command, its reports, its heartbeats), would be the
    ceiling of what W1 measures instead of the control plane; a real cluster's agents
    each have a host of their own."""
    cpus = cpus or os.cpu_count() or 1
    return 1 if cpus < 8 else min(4, cpus // 4)


def sim_shares(hosts: int, procs: int, slice_size: int = 0) -> list[int]:
    """`hosts` split over up to `procs` processes, each a whole number of slices (a slice's
    hosts must share a process: its name is the process's)."""
    unit = max(1, slice_size)
    units = hosts // unit
    procs = max(1, min(procs, units))
    shares = [unit * (units // procs + (1 if k < units % procs else 0)) for k in range(procs)]
    shares[-1] += hosts - sum(shares)
    return shares


def _option(args: list[str], name: str) -> int:
    return int(args[args.index(name) + 1]) if name in args else 0


class Cluster:
    """A fresh stack with `hosts` simulated workers, on one nats-server or on a JetStream
    cluster of `nats_nodes` (`--nats-nodes`; streams with min(nodes, 3) replicas)."""

    nats_nodes = 1
    sim_procs = 0  # --sim-procs; 0: sim_processes()
    lease_ttl: float | None = None  # --lease-ttl
    profile = False  # --profile: every service under cProfile, the scheduler's top printed

    def __init__(self, root: Path, name: str, hosts: int, sim_args: list[str],
                 real_cpu: float | None = None) -> None:
        """`hosts` simulated hosts in one process, or with `real_cpu` that many real
        worker agents (each its own process, running real processes) of that many cpus."""
        self.data = root / name
        # Heartbeats of thousands of simulated hosts are real load: spread them as a real
        # cluster would (documented in docs/performance.md). Above 1,000 hosts the dead
        # timeout is Kubernetes' node grace period, 40 s: the leader's pace may then stretch
        # the interval to 10 s (a third of D - M), so 10,000 hosts beat 1,000 times a
        # second, as 1,000 do (30 s until 2026-11-29: 7.5 s, 1,333 a second).
        interval, dead_after = (1.0, 6.0) if hosts <= 1000 else (5.0, 40.0)
        env = {"BERTH_HEARTBEAT_INTERVAL": str(interval),
               "BERTH_WORKER_DEAD_AFTER": str(dead_after),
               "BERTH_LOG_LEVEL": "INFO"}
        if self.lease_ttl is not None:
            env["BERTH_LEASE_TTL"] = str(self.lease_ttl)
        self.profile_dir = self.data / "profile"
        if self.profile:
            env["BERTH_PROFILE_DIR"] = str(self.profile_dir)
        self.stack: Stack = start_stack(self.data, workers=0, extra_env=env,
                                        nats_nodes=self.nats_nodes)
        self.hosts = hosts
        try:
            if real_cpu is not None:
                for i in range(hosts):
                    self.stack.start_worker(f"w{i}", real_cpu, 4096)
            else:
                shares = sim_shares(hosts, self.sim_procs or sim_processes(),
                                    _option(sim_args, "--sim-slice-size"))
                for k, share in enumerate(shares):
                    name = "sim" if k == 0 else f"sim{k}"
                    self.stack.start_service("worker", "--id", name, "--simulate", str(share),
                                             "--address", "127.0.0.1", *sim_args, label=name)
        except BaseException:  # a SystemExit too (SIGTERM, bench/sigterm.py)
            self.stack.stop()
            raise
        self.nc: NATS | None = None
        self.seen = Observed()
        self._observer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Cluster:
        # `async with` runs no __aexit__ for an __aenter__ that raises (hosts that never
        # registered, a SIGTERM): the stack must still go.
        try:
            self.nc = await nats_io.connect(self.stack.nats.url, "berth-bench",
                                            self.stack.nats.admin_creds())
            self._observer = asyncio.create_task(observe(self.nc, self.seen))
            await self.wait_for_hosts()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def stop_following(self) -> None:
        """Stops the benchmark's follower of the events stream until `when_quiet`: on these
        2 cores, reading and folding every event as it came took ~8 % of the machine in
        W1, from the processes being measured (docs/performance.md)."""
        assert self._observer is not None
        self._observer.cancel()

    async def when_quiet(self, done: Callable[[], bool], cap: float, what: str,
                         snapshot: Callable[[], Snap]) -> tuple[bool, Snap]:
        """After `stop_following`: waits until the events stream has not grown for
        STREAM_QUIET (at most `cap` seconds), then has the follower read what it missed,
        and waits until `done()` judged on all of it (the times it records are the events'
        own). Returns whether `done()` became true, and `snapshot()` as taken by the first
        poll that found the stream no longer growing (within STREAM_POLL of its last event,
        so the readers' fold of the last events is in it, and the quiet wait and the
        catch-up are not), or, if the work had not ended by then, once `done()`. One
        snapshot per pause in the stream, not one per poll: P1's walk of every agent's
        process tree takes milliseconds."""
        assert self.nc is not None and self._observer is not None
        with contextlib.suppress(asyncio.CancelledError):
            await self._observer
        js = self.nc.jetstream()
        started = time.monotonic()
        last_seq, grew, snap = await nats_io.last_event_seq(js), started, snapshot()
        growing = False
        try:
            while time.monotonic() - started < cap:
                await asyncio.sleep(STREAM_POLL)
                seq = await nats_io.last_event_seq(js)
                now = time.monotonic()
                if seq != last_seq:
                    last_seq, grew, growing = seq, now, True
                    continue
                if growing:  # it has just stopped: the work may have ended
                    snap, growing = snapshot(), False
                if now - grew >= STREAM_QUIET:
                    break
        finally:
            self._observer = asyncio.create_task(
                observe(self.nc, self.seen, self.seen.last_seq + 1))
        # The follower catches up (the end of the stream is known: wait for it), then the
        # work is judged on everything.
        await wait_for(self.seen, lambda: self.seen.last_seq >= last_seq, cap,
                       f"{what}: the benchmark to read the events stream")
        if done():
            return True, snap
        left = max(0.0, cap - (time.monotonic() - started))
        complete = await wait_for(self.seen, done, left, what)
        return complete, snapshot()

    async def wait_for_hosts(self) -> None:
        seen = self.seen
        if not await wait_for(seen, lambda: len(seen.registered) >= self.hosts, 120,
                              "hosts to register"):
            raise SystemExit(f"only {len(seen.registered)} of {self.hosts} hosts registered")
        # The scheduler may still be folding the registrations (each records the host's
        # capacity in Redis) when the events stream has them all: a workload submitted
        # then would time that catch-up, not placement.
        async with self.read_only_redis() as redis:
            deadline = time.monotonic() + 120
            while await redis.scard(redis_keys.HOSTS) < self.hosts:
                if time.monotonic() > deadline:
                    raise SystemExit("the scheduler did not record every host in Redis")
                await asyncio.sleep(0.02)

    @contextlib.asynccontextmanager
    async def read_only_redis(self) -> AsyncIterator[Any]:
        """A client of the stack's Redis as the doctor: reads only."""
        redis = redis_io.open_client(self.stack.redis.settings_for(redis_auth.DOCTOR),
                                     redis_io.BULK_READ_TIMEOUT)
        try:
            yield redis
        finally:
            await redis.aclose()

    def scheduler_pid(self) -> int:
        return self.stack.children["scheduler"].pid

    def pids(self) -> dict[str, int]:
        """Every process of the stack: the services (the simulated hosts as "sim"), then
        the servers."""
        pids = {label: proc.pid for label, proc in self.stack.children.items()}
        pids |= {f"nats{i}": node.proc.pid for i, node in enumerate(self.stack.nats.nodes)}
        redis = getattr(self.stack.redis, "proc", None)
        if redis is not None:
            pids["valkey"] = redis.pid
        return pids

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far per process; the simulated hosts' processes summed as "sim"."""
        out: dict[str, float] = {}
        for label, seconds in cpu_by_process(self.pids()).items():
            key = "sim" if SIM_LABEL.match(label) else label
            out[key] = out.get(key, 0.0) + seconds
        return out

    async def idle_rates(self) -> dict[str, float]:
        """CPU seconds per second each process spends on the idle cluster."""
        if self.idle_window <= 0:
            return {}
        before = self.cpu()
        await asyncio.sleep(self.idle_window)
        return {k: v / self.idle_window for k, v in cpu_used(before, self.cpu()).items()}

    # Seconds of idle measured before W1/W4 submit, printed as CPU per second per process:
    # at 1,000 hosts heartbeats cost CPU for every second a run lasts, so a run slowed by
    # other load reads a higher CPU per placement. Right after the hosts registered, so it
    # includes the tail of their registration: an upper bound. --quick: none.
    idle_window = 3.0
    settle = 0.5  # the checker's wait for in-flight commits; --quick: 0.1 (all has ended)

    async def doctor(self, settle: float | None = None) -> dict[str, int]:
        assert self.nc is not None
        async with self.read_only_redis() as redis:
            report = await check_cluster(self.nc.jetstream(), ReservationStore(redis),
                                         settle=self.settle if settle is None else settle)
        violations = report.violations()
        if violations:
            # Which kind, and a few of each: a count alone cannot tell a broken promise from
            # a check made while the log lags Redis (docs/performance.md, twelfth session).
            kinds = collections.Counter(line.split(":", 1)[0] for line in violations)
            print(f"  checker: {len(violations)} violations by kind {dict(kinds)}",
                  file=sys.stderr)
            for kind in kinds:
                for line in [v for v in violations if v.startswith(kind + ":")][:3]:
                    print(f"    {line}", file=sys.stderr)
        if report.releases_owed or report.assignments_unlogged:
            print(f"  checker: {len(report.releases_owed)} releases owed by a leader behind "
                  f"the log (released through seq {report.released_through} of "
                  f"{report.events_seq}) and {len(report.assignments_unlogged)} commits' "
                  "assignments not logged yet: lag, not violations", file=sys.stderr)
        return {"violations": len(violations),
                "double_booked_hosts": report.double_booked_hosts}

    async def __aexit__(self, *exc: object) -> None:
        # Each wait bounded, and named if it runs out: twice in ~40 full W1 runs (the last,
        # 2026-11-28) the benchmark sat idle after its checker, here, and never printed
        # its result.
        steps: list[tuple[str, Callable[[], asyncio.Future[Any]]]] = []
        if (observer := self._observer) is not None:
            observer.cancel()
            steps.append(("the observer's cancellation", lambda: observer))
        if (nc := self.nc) is not None:
            steps.append(("closing the NATS connection", lambda: asyncio.ensure_future(nc.close())))
        for what, start in steps:  # in turn: the connection closes under no follower
            step = start()
            done, _ = await asyncio.wait({step}, timeout=TEARDOWN_WAIT)
            if not done:
                print(f"  teardown: {what} did not end in {TEARDOWN_WAIT:g} s; going on",
                      file=sys.stderr)
            elif not step.cancelled():
                step.exception()  # a connection that failed to close is nothing to report
        self.stack.stop()
        if self.profile:
            print_profiles(self.profile_dir)


def print_profiles(where: Path, top: int = 30) -> None:
    """The scheduler's hottest functions (own time, then cumulative) on stderr."""
    import pstats

    for path in sorted(where.glob("scheduler-*.prof")):
        print(f"\n--- profile {path}", file=sys.stderr)
        stats = pstats.Stats(str(path), stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)


def cpu_cost(used: dict[str, float], units: int, per: str) -> dict[str, Any]:
    """CPU seconds per `per` (e.g. placement) of the scheduler and of every berth process
    (the services and the simulated hosts; also with nats-server and valkey): a measure
    the load of other processes on this machine moves much less than wall-clock rates."""
    services = sum(v for k, v in used.items() if not k.startswith(("nats", "valkey")))
    n = max(units, 1)
    return {
        "cpu_s": used,
        f"scheduler_cpu_ms_per_{per}": round(1000 * used.get("scheduler", 0.0) / n, 3),
        f"berth_cpu_ms_per_{per}": round(1000 * services / n, 3),
        f"all_cpu_ms_per_{per}": round(1000 * sum(used.values()) / n, 3),
    }


def single(i: int, cpu: float = 1) -> bytes:
    return encode(JobSpec(name=f"t{i}", command=["sim"],
                          resources=Resources(cpu=cpu, memory_mb=100)))


async def throughput(root: Path, name: str, hosts: int, jobs: int, cap: float,
                     run_time: str, rate: float | None = None) -> dict[str, Any]:
    # One data directory per run: W4's sizes must not share (and replay) each other's log.
    async with Cluster(root, f"{name}-{hosts}", hosts, ["--cpu", "4", "--memory-mb", "4096",
                                                        "--sim-runtime", run_time]) as c:
        seen = c.seen
        specs = [single(i) for i in range(jobs)]
        idle = await c.idle_rates()
        cpu0 = c.cpu()
        t0 = time.time()
        c.stop_following()
        offered = await submit_all(c.nc, seen, specs, rate=rate)  # type: ignore[arg-type]
        complete, cpu1 = await c.when_quiet(lambda: len(seen.finished) >= jobs, cap,
                                            f"{name}: all {jobs} tasks to finish", c.cpu)
        used = cpu_used(cpu0, cpu1)
        doctor = await c.doctor()
        placed_times = sorted(seen.assigned.values())
        done_times = sorted(seen.finished.values())
        placements = len(placed_times) / max(placed_times[-1] - t0, 1e-9) if placed_times else 0
        completions = len(done_times) / max(done_times[-1] - t0, 1e-9) if done_times else 0
        to_assigned = seen.latencies(seen.assigned)
        to_running = seen.latencies(seen.running)
        return {
            "workload": name, "hosts": hosts, "jobs": jobs, "complete": complete,
            "offered_jobs_per_s": round(offered),
            "placed": len(placed_times), "finished": len(done_times),
            "placements_per_s": round(placements), "completions_per_s": round(completions),
            # Events-stream messages per job (registrations and elections included).
            "events_per_job": round(seen.last_seq / max(jobs, 1), 2),
            "submit_to_assigned_p50_ms": pct(to_assigned, 0.5),
            "submit_to_assigned_p99_ms": pct(to_assigned, 0.99),
            "submit_to_running_p50_ms": pct(to_running, 0.5),
            "submit_to_running_p99_ms": pct(to_running, 0.99),
            # How long each task held its slot, and how busy the slots were kept: what
            # bounds the rate once CPU does not (`slot_use`). 4 one-cpu slots a host.
            "assigned_to_running_p50_ms": pct(between(seen.assigned, seen.running), 0.5),
            "exit_to_slot_refilled_p50_ms": pct(slot_refills(seen, 4), 0.5),
            **slot_use(seen, 4 * hosts),
            "scheduler_peak_rss_mib": round(status_mib(c.scheduler_pid(), "VmHWM"), 1),
            # CPU time of every nats-server of the stack, start to end (R3: three stores).
            "nats_cpu_s": round(sum(cpu_seconds(n.proc.pid) for n in c.stack.nats.nodes), 1),
            "rejected": seen.rejected,
            **cpu_cost(used, len(placed_times), "placement"),
            "idle_cpu_per_s": {k: round(v, 3) for k, v in idle.items()},
            **{f"doctor_{k}": v for k, v in doctor.items()},
        }


async def gangs(root: Path, name: str, slices: int, size: int, count: int, cap: float,
                run_time: str) -> dict[str, Any]:
    hosts = slices * size
    async with Cluster(root, name, hosts, [
            "--cpu", "4", "--memory-mb", "4096", "--tpu", "v5p:2x2x1:4",
            "--sim-slice-size", str(size), "--sim-runtime", run_time]) as c:
        seen = c.seen
        specs = [encode(JobSpec(
            name=f"gang{i}", replicas=size, command=["sim"],
            resources=Resources(cpu=1, memory_mb=100, device=TPU),
            coscheduling=Coscheduling(group_by="tpu-name", order_by="tpu-worker-id")))
            for i in range(count)]
        cpu0 = c.cpu()
        t0 = time.time()
        c.stop_following()
        await submit_all(c.nc, seen, specs)  # type: ignore[arg-type]
        tasks = count * size
        _, cpu1 = await c.when_quiet(lambda: len(seen.finished) >= tasks, cap,
                                     f"{name}: gangs finished", c.cpu)
        complete = len(seen.assigned) >= tasks
        if not complete:
            print(f"  {name}: {len(seen.assigned)} of {tasks} tasks placed", file=sys.stderr)
        place_all = max(seen.assigned.values()) - t0 if seen.assigned else None
        used = cpu_used(cpu0, cpu1)
        doctor = await c.doctor()
        gangs_placed = len({job for job, _ in seen.assigned})
        gaps = slice_gaps(seen)
        return {
            "workload": name, "hosts": hosts, "slices": slices, "gangs": count,
            "gang_size": size, "complete": complete, "gangs_placed": gangs_placed,
            "time_to_place_all_s": round(place_all, 2) if place_all is not None else None,
            "gang_placements_per_s": round(gangs_placed / place_all, 1) if place_all else None,
            # The scheduler's own share of a round: from a slice's gang ending (its last
            # task's exit) to the next gang's assignment there. Rounds are bound by the
            # simulated run times (25 rounds of 0.05-0.15 s per slice) plus this.
            "slice_free_to_next_gang_p50_ms": pct(gaps, 0.5),
            "slice_free_to_next_gang_p99_ms": pct(gaps, 0.99),
            **cpu_cost(used, gangs_placed, "gang"),
            **{f"doctor_{k}": v for k, v in doctor.items()},
        }


async def processes(root: Path, workers: int, cpu: float, jobs: int, cap: float
                    ) -> dict[str, Any]:
    """P1: real worker agents running real processes (`true`), `jobs` one-task jobs
    submitted at once: jobs/s, submit->SUCCEEDED percentiles, CPU per job of every process
    (the workers' reaped task processes and supervisors included)."""
    async with Cluster(root, "P1", workers, [], real_cpu=cpu) as c:
        seen = c.seen
        specs = [encode(JobSpec(name=f"p{i}", command=["true"],
                                resources=Resources(cpu=1, memory_mb=16)))
                 for i in range(jobs)]
        cpu0 = c.cpu()
        machine0, bench0, tasks0 = machine_busy_seconds(), own_cpu_seconds(), seen.task_cpu_s
        t0 = time.time()
        c.stop_following()
        await submit_all(c.nc, seen, specs)  # type: ignore[arg-type]
        complete, (cpu1, machine1, bench1) = await c.when_quiet(
            lambda: len(seen.finished) >= jobs, cap, f"P1: all {jobs} jobs to finish",
            lambda: (c.cpu(), machine_busy_seconds(), own_cpu_seconds()))
        used = cpu_used(cpu0, cpu1)
        # What the machine spent, but for this benchmark's own process: the per-process
        # figures miss most of the supervisors' and tasks' CPU (procstat.py).
        machine = machine1 - machine0 - (bench1 - bench0)
        tasks = seen.task_cpu_s - tasks0
        doctor = await c.doctor()
        done_times = sorted(seen.finished.values())
        ms_per_job = 1000 / max(len(done_times), 1)  # seconds of CPU -> ms per finished job
        to_done = seen.latencies(seen.finished)
        return {
            "workload": "P1", "hosts": workers, "cpu_per_worker": cpu, "jobs": jobs,
            "complete": complete, "finished": len(done_times), "failed": seen.failed,
            "jobs_per_s": round(len(done_times) / max(done_times[-1] - t0, 1e-9), 1)
            if done_times else 0,
            "submit_to_succeeded_p50_ms": pct(to_done, 0.5),
            "submit_to_succeeded_p90_ms": pct(to_done, 0.9),
            "submit_to_succeeded_p99_ms": pct(to_done, 0.99),
            "submit_to_running_p50_ms": pct(seen.latencies(seen.running), 0.5),
            "submit_to_assigned_p50_ms": pct(seen.latencies(seen.assigned), 0.5),
            # Where a job's time goes once placed: on its worker (the report stamps).
            "assigned_to_running_p50_ms": pct(between(seen.assigned, seen.running), 0.5),
            "running_to_finished_p50_ms": pct(between(seen.running, seen.finished), 0.5),
            "exit_to_slot_refilled_p50_ms": pct(slot_refills(seen, int(cpu)), 0.5),
            "events_per_job": round(seen.last_seq / max(jobs, 1), 2),
            **cpu_cost(used, len(done_times), "job"),
            "machine_cpu_ms_per_job": round(machine * ms_per_job, 3),
            # The same, less what the tasks' own processes (`true`) used: berth's whole
            # stack, the supervisors, NATS and valkey included.
            "stack_cpu_ms_per_job": round((machine - tasks) * ms_per_job, 3),
            "task_cpu_ms_per_job": round(tasks * ms_per_job, 3),
            **{f"doctor_{k}": v for k, v in doctor.items()},
        }


def slot_refills(seen: Observed, slots: int) -> list[float]:
    """Per worker running `slots` tasks at a time, all alike: the seconds from each exit to
    the assignment that took its slot (the n-th exit frees the slot of the n+slots-th
    assignment there). How long the scheduler left a slot empty, the exit report's trip
    to it included."""
    by_worker: dict[str, tuple[list[float], list[float]]] = {}
    for key, ts in seen.assigned.items():
        by_worker.setdefault(seen.worker_of[key], ([], []))[0].append(ts)
        if key in seen.finished:
            by_worker[seen.worker_of[key]][1].append(seen.finished[key])
    gaps = []
    for assigned, finished in by_worker.values():
        assigned.sort()
        finished.sort()
        gaps += [max(0.0, a - f) for a, f in zip(assigned[slots:], finished, strict=False)]
    return gaps


def slot_use(seen: Observed, slots: int) -> dict[str, float | None]:
    """What bounds a throughput run's rate besides CPU. By Little's law the placement rate
    is `slots x busy / held`: `held` the mean seconds a task holds its slot (assigned to
    exit: its run time, its run command's way to the host and its exit report's way back),
    `busy` the share of slot-time held from the first placement to the last (a freed slot
    waits for the scheduler to hear of the exit and place again). `slots / held` is the
    rate were no slot ever left empty: a ceiling no amount of CPU lifts. Where every core
    is busy (2 cores), `busy` and `held` show the contention; with cores to spare, whether
    a run reached that ceiling."""
    spans = [(a, seen.finished[k]) for k, a in seen.assigned.items() if k in seen.finished]
    if not spans or slots <= 0:
        return {"slot_held_s": None, "slots_busy": None, "slot_bound_per_s": None}
    start, end = min(a for a, _ in spans), max(a for a, _ in spans)
    inside = sum(max(0.0, min(f, end) - max(a, start)) for a, f in spans)
    mean = sum(max(0.0, f - a) for a, f in spans) / len(spans)
    return {"slot_held_s": round(mean, 3),
            "slots_busy": round(inside / (slots * (end - start)), 3) if end > start else None,
            "slot_bound_per_s": round(slots / mean) if mean > 0 else None}


def between(earlier: dict[tuple[str, int], float], later: dict[tuple[str, int], float]
            ) -> list[float]:
    """Per task stamped in both, the seconds from the one to the other."""
    return [max(0.0, later[k] - ts) for k, ts in earlier.items() if k in later]


def slice_gaps(seen: Observed) -> list[float]:
    """Per group, the time from each gang's last exit to the next gang's first assignment."""
    rounds: dict[str, list[tuple[float, float]]] = {}  # group -> (assigned, last exit)
    for job, group in seen.group_of.items():
        assigned = [ts for (j, _), ts in seen.assigned.items() if j == job]
        ended = [ts for (j, _), ts in seen.finished.items() if j == job]
        if assigned and ended:
            rounds.setdefault(group, []).append((min(assigned), max(ended)))
    gaps = []
    for runs in rounds.values():
        runs.sort()
        gaps += [max(0.0, nxt[0] - cur[1]) for cur, nxt in itertools.pairwise(runs)]
    return gaps


async def standing_queue(root: Path, name: str, hosts: int, waiting: int, settle: float,
                         window: float, run_time: str) -> dict[str, Any]:
    """W6 and W7: a full cluster with `waiting` more tasks queued; CPU per second of each
    process over `window` seconds, `settle` seconds after the last slot was taken."""
    slots = 4 * hosts
    async with Cluster(root, f"{name}-{hosts}", hosts, ["--cpu", "4", "--memory-mb", "4096",
                                                        "--sim-runtime", run_time]) as c:
        seen = c.seen
        jobs = slots + waiting
        await submit_all(c.nc, seen, [single(i) for i in range(jobs)])
        full = await wait_for(seen, lambda: len(seen.assigned) >= slots, 120,
                              "W6: every slot to be taken")
        await asyncio.sleep(settle)
        before, placed_before = c.cpu(), len(seen.assigned)
        await asyncio.sleep(window)
        rates = {k: round(v / window, 3) for k, v in cpu_used(before, c.cpu()).items()}
        placed_in_window = len(seen.assigned) - placed_before
        doctor = await c.doctor()
        return {
            "workload": name, "hosts": hosts, "slots": slots, "waiting": waiting,
            "full": full, "placed": len(seen.assigned), "window_s": window,
            "placements_per_s_in_window": round(placed_in_window / window, 1),
            "scheduler_cpu_ms_per_placement_in_window": round(
                1000 * rates.get("scheduler", 0.0) * window / placed_in_window, 3)
            if placed_in_window else None,
            "cores": rates, "scheduler_cores": rates.get("scheduler", 0.0),
            "all_cores": round(sum(rates.values()), 3),
            **{f"doctor_{k}": v for k, v in doctor.items()},
        }


async def latency(root: Path, hosts: int, jobs: int) -> dict[str, Any]:
    async with Cluster(root, "W3", hosts, ["--cpu", "4", "--memory-mb", "4096",
                                           "--sim-runtime", "const:0.05"]) as c:
        seen = c.seen
        for i in range(jobs):
            await submit_all(c.nc, seen, [single(i)])  # type: ignore[arg-type]
            await wait_for(seen, lambda n=i + 1: len(seen.running) >= n, 30, "W3: running")
        to_running = seen.latencies(seen.running)
        to_assigned = seen.latencies(seen.assigned)
        return {
            "workload": "W3", "hosts": hosts, "jobs": jobs,
            "submit_to_assigned_p50_ms": pct(to_assigned, 0.5),
            "submit_to_running_p50_ms": pct(to_running, 0.5),
            "submit_to_running_p99_ms": pct(to_running, 0.99),
            "submit_to_running_mean_ms": round(1000 * statistics.mean(to_running), 1)
            if to_running else None,
        }


FILL_WAVE = 25  # W5's batch gangs submitted at once


async def preemption(root: Path, slices: int, size: int, count: int, cap: float
                     ) -> dict[str, Any]:
    """W5: every host runs a batch gang; `count` production gangs arrive at once, each
    able to run only by evicting a batch gang whole."""
    hosts = slices * size
    async with Cluster(root, "W5", hosts, [
            "--cpu", "4", "--memory-mb", "4096", "--tpu", "v5p:2x2x1:4",
            "--sim-slice-size", str(size), "--sim-runtime", "const:3600"]) as c:
        seen = c.seen

        def gang_specs(name: str, n: int, priority: Priority) -> list[bytes]:
            return [encode(JobSpec(
                name=f"{name}{i}", replicas=size, command=["sim"], priority=priority,
                resources=Resources(cpu=1, memory_mb=100, device=TPU),
                coscheduling=Coscheduling(group_by="tpu-name", order_by="tpu-worker-id")))
                for i in range(n)]

        # The fill in waves of 25 gangs: one tick of 1,000 placements is not what W5
        # measures, and on a loaded machine it can outlast the lease (docs/performance.md).
        batch = gang_specs("batch", slices, Priority.BATCH)
        filled = True
        for start in range(0, slices, FILL_WAVE):
            await submit_all(c.nc, seen, batch[start:start + FILL_WAVE])  # type: ignore[arg-type]
            wave = min(slices, start + FILL_WAVE) * size
            filled = await wait_for(seen, lambda n=wave: len(seen.running) >= n, cap,
                                    "W5: batch gangs running on every host")
            if not filled:
                break
        batch_jobs = set(seen.job_seq)
        if not filled:
            return {"workload": "W5", "hosts": hosts, "slices": slices, "gangs": count,
                    "gang_size": size, "complete": False,
                    "batch_running": len(seen.running)}
        print(f"  W5: {hosts} hosts busy; submitting {count} production gangs",
              file=sys.stderr, flush=True)
        t0 = time.time()
        await submit_all(c.nc, seen, gang_specs("prod", count, Priority.PRODUCTION))  # type: ignore[arg-type]

        def prod_running() -> list[float]:
            return [ts for (job, _), ts in seen.running.items() if job not in batch_jobs]

        complete = await wait_for(
            seen, lambda: len(prod_running()) >= count * size, cap,
            f"W5: all {count} production gangs running")
        all_running = max(prod_running()) - t0 if prod_running() else None
        evicted = [k for _, _, victims in seen.preemptions for k in victims]
        evict_times = [ts for ts, _, _ in seen.preemptions]
        exits = [seen.exits[k] for k in evicted if k in seen.exits]
        # Per preemptor: from its last victim's exit (the end of its grace) to its last
        # task running.
        # Split in two: from the last victim's exit to the assignment (the scheduler's
        # part: folding the exits, the tick, the commit), then to RUNNING (logging,
        # dispatch, the worker's report).
        waits, to_assigned, to_running = [], [], []
        for _, job, victims in seen.preemptions:
            gone = [seen.exits[k] for k in victims if k in seen.exits]
            started = [ts for (j, _), ts in seen.running.items() if j == job]
            assigned = [ts for (j, _), ts in seen.assigned.items() if j == job]
            if gone and len(started) == size:
                waits.append(max(started) - max(gone))
                to_assigned.append(max(assigned) - max(gone))
                to_running.append(max(started) - max(assigned))
        doctor = await c.doctor(settle=0.5)  # commits may still be in flight here
        span = (max(exits) - min(evict_times)) if exits and evict_times else None
        return {
            "workload": "W5", "hosts": hosts, "slices": slices, "gangs": count,
            "gang_size": size, "complete": complete,
            "gangs_running": len({job for (job, _) in seen.running if job not in batch_jobs}),
            "time_to_all_running_s": round(all_running, 2) if all_running is not None else None,
            "evictions": len(evicted),
            "evictions_per_s": round(len(evicted) / span, 1) if span else None,
            "placed_after_last_victim_p50_s": round(statistics.median(waits), 2)
            if waits else None,
            "placed_after_last_victim_max_s": round(max(waits), 2) if waits else None,
            "exit_to_assigned_p50_s": round(statistics.median(to_assigned), 2)
            if to_assigned else None,
            "assigned_to_running_p50_s": round(statistics.median(to_running), 2)
            if to_running else None,
            **{f"doctor_{k}": v for k, v in doctor.items()},
        }


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'workload':<10}{'hosts':>7}  result"]
    for r in results:
        if r["workload"] in ("W2", "W8"):
            what = (f"{r['gangs_placed']}/{r['gangs']} gangs placed in "
                    f"{r['time_to_place_all_s']} s ({r['gang_placements_per_s']}/s), "
                    f"slice free->next gang p50 {r['slice_free_to_next_gang_p50_ms']} ms, "
                    f"CPU ms/gang: scheduler {r['scheduler_cpu_ms_per_gang']}, berth "
                    f"{r['berth_cpu_ms_per_gang']}, doctor violations={r['doctor_violations']}")
        elif r["workload"] == "W5" and "gangs_running" not in r:
            what = f"the batch gangs never filled the hosts ({r['batch_running']} running)"
        elif r["workload"] == "W5":
            what = (f"{r['gangs_running']}/{r['gangs']} production gangs running in "
                    f"{r['time_to_all_running_s']} s, {r['evictions']} evictions "
                    f"({r['evictions_per_s']}/s), placed after the last victim's exit: p50 "
                    f"{r['placed_after_last_victim_p50_s']} s, max "
                    f"{r['placed_after_last_victim_max_s']} s, doctor violations="
                    f"{r['doctor_violations']}")
        elif r["workload"] == "P1":
            what = (f"{r['finished']}/{r['jobs']} real jobs done ({r['failed']} failed), "
                    f"{r['jobs_per_s']} jobs/s, submit->SUCCEEDED p50 "
                    f"{r['submit_to_succeeded_p50_ms']} ms p99 "
                    f"{r['submit_to_succeeded_p99_ms']} ms, CPU ms/job: scheduler "
                    f"{r['scheduler_cpu_ms_per_job']}, berth {r['berth_cpu_ms_per_job']}, "
                    f"all {r['all_cpu_ms_per_job']}; the machine but this benchmark "
                    f"{r['machine_cpu_ms_per_job']}, of it the tasks' own "
                    f"{r['task_cpu_ms_per_job']} and berth's stack "
                    f"{r['stack_cpu_ms_per_job']}; doctor violations="
                    f"{r['doctor_violations']}")
        elif r["workload"] == "W6":
            what = (f"{r['placed']}/{r['slots']} slots taken, {r['waiting']} waiting: "
                    f"scheduler {r['scheduler_cores']} cores, all processes "
                    f"{r['all_cores']} cores, doctor violations={r['doctor_violations']}")
        elif r["workload"] == "W7":
            what = (f"{r['slots']} slots refilled from {r['waiting']} waiting: "
                    f"{r['placements_per_s_in_window']} placements/s, scheduler "
                    f"{r['scheduler_cores']} cores "
                    f"({r['scheduler_cpu_ms_per_placement_in_window']} ms per placement), "
                    f"all processes {r['all_cores']} cores, doctor violations="
                    f"{r['doctor_violations']}")
        elif r["workload"] == "W3":
            what = (f"submit->RUNNING p50 {r['submit_to_running_p50_ms']} ms, "
                    f"p99 {r['submit_to_running_p99_ms']} ms")
        else:
            what = (f"{r['placements_per_s']} placements/s, {r['completions_per_s']} "
                    f"completions/s, submit->ASSIGNED p50 {r['submit_to_assigned_p50_ms']} ms "
                    f"p99 {r['submit_to_assigned_p99_ms']} ms, scheduler peak RSS "
                    f"{r['scheduler_peak_rss_mib']} MiB ({r['placed']}/{r['jobs']} placed), "
                    f"CPU ms/placement: scheduler {r['scheduler_cpu_ms_per_placement']}, "
                    f"berth {r['berth_cpu_ms_per_placement']}, doctor violations="
                    f"{r['doctor_violations']}")
        lines.append(f"{r['workload']:<10}{r['hosts']:>7}  {what}")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    quick = args.quick
    only = {w.strip().upper() for w in args.only.split(",")} if args.only else None
    results: list[dict[str, Any]] = []

    def wanted(name: str) -> bool:
        return only is None or name in only

    def emit(result: dict[str, Any]) -> None:
        result["machine_cpus"] = os.cpu_count()
        result["sim_processes"] = Cluster.sim_procs or sim_processes()
        result["nats_nodes"] = Cluster.nats_nodes
        result["stream_replicas"] = min(Cluster.nats_nodes, 3)
        results.append(result)
        print(json.dumps(result), flush=True)

    with contextlib.ExitStack() as cleanup:
        if args.keep:
            root = Path(tempfile.mkdtemp(prefix="berth-scale-"))
            print(f"keeping data and logs in {root}", file=sys.stderr)
        else:
            root = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="berth-scale-")))
        if wanted("W1"):
            emit(await throughput(root, "W1", args.hosts or (40 if quick else 1000),
                                  args.jobs or (400 if quick else 20_000), 20 if quick else 300,
                                  "uniform:0.1:0.3" if quick else "uniform:0.5:1.5",
                                  rate=args.rate))
        if wanted("W2"):
            emit(await gangs(root, "W2", 4 if quick else 8, 8, 20 if quick else 200,
                             20 if quick else 300, "uniform:0.05:0.15"))
        if wanted("W8"):
            # A slice for every gang: none waits for another to end, so the time to place
            # them all is the scheduler's alone.
            emit(await gangs(root, "W8", 20 if quick else 200, 8, 20 if quick else 200,
                             20 if quick else 300, "uniform:0.05:0.15"))
        if wanted("W3"):
            emit(await latency(root, 10 if quick else 100, 20 if quick else 200))
        if wanted("W4"):
            # One size in --quick: the same code path as W1, and a stack fewer for CI (P1 adds one).
            sizes = [20] if quick else args.w4_sizes
            # --quick: W1's short run times; the checks (keys, doctor) need no second of
            # simulated work per task, which made W4 the longest quick workload.
            # The same number of tasks at every size, 20 per host of the largest: each size
            # then runs as long, at steady state. (Until 2026-11-29 each size ran 20 x its
            # own hosts, so 1,000 hosts ran ~8 s and 10,000 ~100 s: the short run's rate
            # left out what trails its last placement; docs/performance.md.)
            jobs = 20 * max(sizes)
            for hosts in sizes:
                emit(await throughput(root, "W4", hosts, jobs,
                                      8 if quick else args.w4_cap,
                                      "uniform:0.1:0.3" if quick else "uniform:0.5:1.5"))
        if wanted("W6"):
            emit(await standing_queue(root, "W6", 10 if quick else 1000,
                                      400 if quick else 36_000, 1 if quick else 5,
                                      2 if quick else 20, "const:3600"))
        if wanted("W7"):
            emit(await standing_queue(root, "W7", 10 if quick else 1000,
                                      400 if quick else 36_000, 1 if quick else 5,
                                      2 if quick else 20,
                                      "uniform:0.5:1.5" if quick else "uniform:5:15"))
        if wanted("P1"):
            emit(await processes(root, 1 if quick else 8, 4 if quick else 8,
                                 12 if quick else 500, 30 if quick else 300))
        if wanted("W5"):
            emit(await preemption(root, 4 if quick else 125, 8, 2 if quick else 100,
                                  30 if quick else 300))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description="berth's scale benchmark (see the module docstring)")
    parser.add_argument("--quick", action="store_true",
                        help="a small version of each workload, under a minute")
    parser.add_argument("--only", help="comma-separated workloads, e.g. W1,W3")
    parser.add_argument("--keep", action="store_true",
                        help="keep each stack's data and service logs (the path is printed)")
    parser.add_argument("--jobs", type=int, help="W1's job count (default 20,000)")
    parser.add_argument("--hosts", type=int, help="W1's simulated hosts (default 1,000)")
    parser.add_argument("--rate", type=float,
                        help="W1's offered load in jobs/s (default: as fast as the client can)")
    parser.add_argument("--w4-sizes", type=lambda v: [int(n) for n in v.split(",")],
                        default=[1000, 5000, 10_000],
                        help="W4's host counts (default 1000,5000,10000)")
    parser.add_argument("--w4-cap", type=float, default=180,
                        help="seconds each W4 size may run (default 180)")
    parser.add_argument("--nats-nodes", type=int, default=1,
                        help="run NATS as a JetStream cluster of N nodes on this machine, "
                        "streams with min(N, 3) replicas (default: 1 server, R1)")
    parser.add_argument("--profile", action="store_true",
                        help="run every service under cProfile (BERTH_PROFILE_DIR) and print "
                        "the scheduler's hottest functions after each workload")
    parser.add_argument("--lease-ttl", type=float,
                        help="BERTH_LEASE_TTL for the stack (default 3 s): on a machine "
                        "loaded by other work a starved leader loses its lease and replays, "
                        "which is what a run then measures")
    parser.add_argument("--sim-procs", type=int, default=0,
                        help="processes the simulated hosts are spread over (default: 1 "
                        "below 8 cores, else one per 4 cores, at most 4)")
    args = parser.parse_args()
    tear_down_on_sigterm()
    Cluster.nats_nodes = args.nats_nodes
    Cluster.sim_procs = args.sim_procs
    Cluster.profile = args.profile
    if args.quick:
        Cluster.settle = 0.1
        Cluster.idle_window = 0.0
    Cluster.lease_ttl = args.lease_ttl
    results = asyncio.run(run(args))
    print(f"\nNATS: {args.nats_nodes} node(s), streams with {min(args.nats_nodes, 3)} "
          "replica(s)\n" + table(results), file=sys.stderr)


if __name__ == "__main__":
    main()
