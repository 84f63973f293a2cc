"""Fault scenarios against a real stack (berth.stack.start_stack: nats-server, valkey, the
submitter, a leader and a standby scheduler, the dashboard, workers), each bounded in time,
each counting what must read 0:

- `lost`: acknowledged submits (the submit stream's PubAck) with no job in the end;
- `not_terminal`: jobs not in a terminal state after the bounded wait;
- `reports_lost`: attempts never confirmed gone, or ended without a report of their own
  (neither a terminal report nor a worker written off);
- `reports_twice`: attempts with two different terminal reports in the fold, or tasks whose
  failure count exceeds their failed attempts (a report folded twice);
- `double_booked`: hosts and (address, port) pairs, by berth doctor's checker, sampled
  during the run and at the end;
- `checker`: any other checker violation at the end (e.g. a live attempt whose reservation
  Redis lost, or a reservation of an attempt that exited);
- `two_copies`: tasks seen with two live attempts at once (/proc, every 0.1 s);
- `orphans`: task processes alive after the stack stopped;
- `projection`: jobs and workers the dashboard shows otherwise than a fresh fold of the log;
- `epochs_reused`: `leader_elected` events not above every earlier one in the log;
- `died`: services that exited without the scenario killing them.

Tasks carry a token (one tag per run) in their argv and run until a stop file appears, so
the sampler sees which attempt of which task is alive where (tests/faults/procs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
from nats.aio.client import Client as NATS

from berth.client import publish_submit, wait_for_outcome
from berth.services.dashboard_api import views
from berth.shared import nats_io, redis_auth, redis_io, servers, subjects
from berth.shared.checker import Report, check_cluster
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    Coscheduling,
    JobSpec,
    LeaderElected,
    Resources,
    attempt_key,
    encode,
    reports_in,
)
from berth.shared.reservations import ReservationStore
from berth.shared.states import TaskState
from berth.stack import Stack, start_stack, wait_for_api
from tests.faults import fuzz
from tests.faults.procs import Sampler, tagged
from tests.test_projection import as_json

# Heartbeat 0.5 s, D = 6 s (workers fence at 4.5 s), lease TTL 2 s: a take-over (about
# 2.7 s plus its catch-up) is answered before any worker fences, as docs/reliability.md
# asks of D; a dead worker is written off 6 s after its last heartbeat.
ENV = {"BERTH_HEARTBEAT_INTERVAL": "0.5", "BERTH_WORKER_DEAD_AFTER": "6",
       "BERTH_LEASE_TTL": "2", "BERTH_KILL_GRACE": "2", "BERTH_TICK_INTERVAL": "0.2",
       "BERTH_SNAPSHOT_INTERVAL": "2"}
TERMINAL = {"succeeded", "failed", "killed", "unschedulable"}
ENDED = {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.KILLED}
# Runs until the stop file ($0) exists; the token ($1) is only there to be found in /proc.
TASK = 'while [ ! -e "$0" ]; do sleep 0.1; done'
TINY = Resources(cpu=0.05, memory_mb=8)
COUNTS = ("acked", "lost", "not_terminal", "reports_lost", "reports_twice", "double_booked",
          "checker", "two_copies", "orphans", "projection", "epochs_reused")


@dataclass
class Counts:
    scenario: str
    acked: int = 0
    lost: int = 0
    not_terminal: int = 0
    reports_lost: int = 0
    reports_twice: int = 0
    double_booked: int = 0
    checker: int = 0
    two_copies: int = 0
    orphans: int = 0
    projection: int = 0
    epochs_reused: int = 0
    died: list[str] = field(default_factory=list)
    # Measured, not judged.
    notes: dict[str, Any] = field(default_factory=dict)

    def violations(self) -> list[str]:
        out = [f"{name}={getattr(self, name)}" for name in COUNTS[1:] if getattr(self, name)]
        if self.died:
            out.append(f"died={self.died}")
        return out


def attempt_counts(state: ClusterState, reports: dict[str, set[TaskState]],
                   job_ids: set[str]) -> tuple[int, int]:
    """(reports lost, reports applied twice) over the jobs `job_ids`, from a fold of the
    whole log and the terminal report states the log holds per attempt key."""
    lost = twice = 0
    for job_id in job_ids:
        job = state.jobs.get(job_id)
        if job is None:
            continue
        for task in job.tasks:
            for attempt in task.attempts:
                seen = reports.get(attempt_key(job_id, task.index, attempt.attempt_id), set())
                if not attempt.exited or (not attempt.worker_failure and not seen):
                    lost += 1
                twice += len(seen) > 1
            failed = sum(a.state == TaskState.FAILED for a in task.attempts)
            twice += task.failure_count > failed
    return lost, twice


def epochs_reused(epochs: list[int]) -> int:
    """Elections whose epoch is not above every earlier one."""
    reused, top = 0, 0
    for epoch in epochs:
        reused += epoch <= top
        top = max(top, epoch)
    return reused


class FaultRun:
    """One scenario's stack, jobs and observers. Use as `async with`."""

    def __init__(self, data_dir: Path, name: str, workers: int = 3, standby: bool = True,
                 check_every: float = 2.0, scale: float = 1.0) -> None:
        self.data_dir = data_dir
        self.counts = Counts(name)
        self.workers = workers
        self.standby = standby
        self.check_every = check_every
        self.scale = scale  # of every batch of jobs a scenario submits (the quick form: less)
        self.tag = f"faulttok-{uuid.uuid4().hex[:8]}"
        self.stop_file = data_dir / f"stop-{self.tag}"
        self.sampler = Sampler(self.tag)
        self.stack: Stack | None = None
        self.nc: NATS | None = None
        self.seqs: dict[int, str] = {}  # submit seq -> token (acknowledged submits)
        self.job_ids: dict[int, str] = {}  # submit seq -> job id
        self.killed: set[str] = set()  # labels the scenario killed on purpose
        self.max_double_booked = 0
        self.checker_seen: set[str] = set()  # violations of check_now
        # The fuzz's: whether a finding is about its forged job and worker alone (noted as
        # `forged`, not counted: tests/faults/fuzz.py FORGED_REUSE).
        self.forged_only: Callable[[str], bool] | None = None
        self.submitted = 0
        self._checker: asyncio.Task[None] | None = None
        self.started = time.monotonic()

    # --- the stack ------------------------------------------------------------------------

    async def __aenter__(self) -> FaultRun:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.stack = await asyncio.to_thread(
            start_stack, self.data_dir, workers=self.workers, worker_cpu=2,
            extra_env=ENV)
        if self.standby:
            self.stack.start_service("scheduler", label="scheduler-2")
        self.nc = await nats_io.connect(self.stack.nats.url, "berth-faults",
                                        self.stack.nats.admin_creds())
        self.sampler.start()
        await self.until("the workers registered",
                         lambda: len(self.get("/api/workers")) >= self.workers, 30)
        await self.until("a leader", self.leader_label, 30)
        if self.check_every:
            self._checker = asyncio.create_task(self._check_loop())
        self.mark("up")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(BaseException):
                await self._checker
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        if self.stack is not None:
            self.counts.died = self.died()
            await asyncio.to_thread(self.stack.stop)
            self.mark("stopped")
        self.sampler.stop()
        # What outlived the stack: a task process, or a supervisor, carrying our tag.
        await asyncio.sleep(0.5)
        self.counts.orphans = len(tagged(self.tag))

    @property
    def s(self) -> Stack:
        assert self.stack is not None
        return self.stack

    @property
    def bus(self) -> NATS:
        assert self.nc is not None
        return self.nc

    def mark(self, what: str) -> None:
        """Seconds from the start of the run to `what`, in the notes."""
        self.counts.notes.setdefault("marks", {})[what] = round(time.monotonic() - self.started, 1)

    def died(self) -> list[str]:
        return [f"{label} ({proc.returncode})" for label, proc in self.s.children.items()
                if proc.poll() is not None and label not in self.killed]

    def log(self, label: str) -> str:
        path = self.s.data_dir / "logs" / f"{label}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def get(self, path: str) -> Any:
        resp = httpx.get(self.s.api_url + path, timeout=10,
                         headers={"Authorization": f"Bearer {self.s.api_token}"})
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()

    async def until(self, what: str, predicate: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, OSError):
                if got := predicate():
                    return got
            await asyncio.sleep(0.2)
        self.counts.notes.setdefault("timeouts", []).append(what)
        return None

    # --- faults ---------------------------------------------------------------------------

    async def leader_pid(self) -> int | None:
        """The pid of the scheduler named by the newest `leader_elected` (its id is
        host-pid-random)."""
        with contextlib.suppress(Exception):
            msg = await self.bus.jetstream().get_last_msg(subjects.EVENTS_STREAM,
                                                          subjects.LEADER_EVENTS)
            event = msgspec.json.decode(msg.data or b"", type=LeaderElected)
            return int(event.scheduler_id.rsplit("-", 2)[1])
        return None

    def leader_label(self) -> str | None:
        """The label of the scheduler leading now, by its log's last word on it."""
        for label in ("scheduler", "scheduler-2", "scheduler-3"):
            if label not in self.s.children or self.s.children[label].poll() is not None:
                continue
            text = self.log(label)
            lead = text.rfind("leading with epoch")
            if lead >= 0 and lead > max(text.rfind("lost leadership"),
                                        text.rfind("standing down")):
                return label
        return None

    async def signal_leader(self, sig: signal.Signals) -> str:
        pid = await self.leader_pid()
        label = next((k for k, p in self.s.children.items() if p.pid == pid), None)
        assert label is not None, f"no scheduler with pid {pid}"
        self.s.children[label].send_signal(sig)
        if sig == signal.SIGKILL:
            self.killed.add(label)
        self.counts.notes.setdefault("signalled", []).append(f"{label}:{sig.name}")
        return label

    def kill(self, label: str) -> None:
        self.killed.add(label)
        self.s.children[label].send_signal(signal.SIGKILL)
        self.s.children[label].wait()

    def restart_service(self, name: str, label: str) -> None:
        self.killed.discard(label)
        if name == "worker":
            self.s.start_worker(label, 2)
        else:
            self.s.start_service(name, label=label)
        if name == "dashboard":
            wait_for_api(self.s)

    def kill_nats(self) -> None:
        proc = self.s.nats.proc
        assert proc is not None
        proc.kill()
        proc.wait()

    def start_nats(self) -> None:
        """nats-server again on its port, with its JetStream store."""
        self.s.nats = servers.start_nats(self.s.data_dir, self.s.nats.port)

    def kill_redis(self) -> None:
        assert isinstance(self.s.redis, servers.RedisServer)
        proc = self.s.redis.proc
        assert proc is not None
        proc.kill()
        proc.wait()

    def start_redis(self, empty: bool) -> None:
        """valkey again on its port: with its AOF, or with its data dir emptied (its users
        are written again from the data dir's auth, as a fresh install would)."""
        if empty:
            shutil.rmtree(self.s.data_dir / "redis")
        self.s.redis = servers.start_redis(self.s.data_dir, self.s.redis.port)

    # --- jobs -----------------------------------------------------------------------------

    def spec(self, token: str, cpu: float = 0.25, **kw: Any) -> JobSpec:
        return JobSpec(name=token, command=["sh", "-c", TASK, str(self.stop_file), token],
                       resources=Resources(cpu=cpu, memory_mb=16), **kw)

    async def submit(self, specs: list[JobSpec], deadline_s: float = 30) -> list[int]:
        """Publishes each submit, retrying a failed publish with the same message id (NATS
        may be down) until it is acknowledged or `deadline_s` passes; returns the acked
        submit sequences."""
        acked = []
        for spec in specs:
            msg_id = f"{self.tag}-{spec.name}"
            deadline = time.monotonic() + deadline_s
            while True:
                try:
                    seq = await publish_submit(self.bus, encode(spec), msg_id=msg_id)
                    break
                except (nats.errors.Error, TimeoutError, OSError):
                    if time.monotonic() > deadline:
                        seq = 0
                        break
                    await asyncio.sleep(0.2)
            if seq:
                self.seqs[seq] = spec.name
                acked.append(seq)
        self.counts.acked = len(self.seqs)
        return acked

    def tokens(self, n: int, prefix: str = "") -> list[str]:
        out = []
        for _ in range(max(2, round(n * self.scale))):
            self.submitted += 1
            out.append(f"{self.tag}-{prefix}{self.submitted}")
        return out

    async def long_jobs(self, n: int, **kw: Any) -> list[int]:
        """`n` jobs whose tasks run until the stop file appears."""
        return await self.submit([self.spec(t, **kw) for t in self.tokens(n)])

    async def short_jobs(self, n: int) -> list[int]:
        """A burst of `n` jobs whose tasks end at once (the stop file is their argv[0]'s
        target: /)."""
        return await self.submit([
            JobSpec(name=t, command=["sh", "-c", TASK, "/", t], resources=TINY)
            for t in self.tokens(n, "s")])

    async def gang_jobs(self, n: int, replicas: int) -> list[int]:
        return await self.submit([
            self.spec(t, cpu=0.5, replicas=replicas, ports=["coordinator"],
                      coscheduling=Coscheduling(group_by="slice"))
            for t in self.tokens(n, "g")])

    async def job_of(self, seq: int, timeout: float = 60) -> str | None:
        if seq in self.job_ids:
            return self.job_ids[seq]
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            outcome = await wait_for_outcome(self.bus, seq, timeout=timeout)
            if outcome.job_id is not None:
                self.job_ids[seq] = str(outcome.job_id)
                return self.job_ids[seq]
            self.counts.notes.setdefault("rejected", []).append(outcome.reason)
        return None

    async def running(self, seqs: list[int], timeout: float = 30) -> bool:
        ids = [await self.job_of(seq) for seq in seqs]

        def all_running() -> bool:
            return all(i is not None and (j := self.get(f"/api/jobs/{i}")) is not None
                       and j["state"] == "running" for i in ids)

        return bool(await self.until(f"{len(ids)} jobs running", all_running, timeout))

    # --- counting -------------------------------------------------------------------------

    async def check(self) -> Report:
        store = redis_io.open_client(self.s.redis.settings_for(redis_auth.DOCTOR))
        try:
            report = await check_cluster(self.bus.jetstream(), ReservationStore(store),
                                         settle=0.5)
        finally:
            await store.aclose()
        self.max_double_booked = max(self.max_double_booked,
                                     report.double_booked_hosts + report.double_booked_ports)
        return report

    async def check_now(self, when: str, settle: float = 10.0) -> None:
        """A check whose every violation counts (not only the double-booking), for moments
        the stack must be whole again, e.g. a new term after an outage. A disagreement
        between Redis and the log counts if it lasts `settle` seconds; how long it took to
        clear is noted."""
        started = time.monotonic()
        while True:
            report = await self.check()
            if not report.violations() or time.monotonic() - started > settle:
                break
            await asyncio.sleep(0.5)
        if waited := round(time.monotonic() - started, 1):
            self.counts.notes[f"{when}: checker clear after s"] = waited
        self.checker_seen |= {f"{when}: {v}" for v in report.violations()}

    async def elections(self) -> int:
        msgs = await nats_io.read_subject(self.bus.jetstream(), subjects.EVENTS_STREAM,
                                          subjects.LEADER_EVENTS)
        return len(msgs)

    async def until_new_term(self, terms: int, timeout: float = 30) -> None:
        """Until a leader elected after the first `terms` elections has had a second to
        reconcile Redis with the log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if await self.elections() > terms:
                    await asyncio.sleep(1)
                    return
            await asyncio.sleep(0.2)
        self.counts.notes.setdefault("timeouts", []).append("a new term")

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_every)
            # Redis or NATS may be down on purpose: a check that cannot read counts nothing.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.check(), 20)

    async def fold(self) -> tuple[ClusterState, dict[str, set[TaskState]], list[int]]:
        """A fresh fold of the whole log, the terminal report states per attempt, and the
        epochs of every election in log order."""
        js = self.bus.jetstream()
        until = await nats_io.last_event_seq(js)
        state = ClusterState()
        reports: dict[str, set[TaskState]] = {}
        epochs: list[int] = []
        events = nats_io.follow_events(js)
        try:
            while state.last_seq < until:
                record = await anext(events)
                event = record.event
                for report in reports_in(event):
                    if report.state in ENDED:
                        key = attempt_key(report.job_id, report.task_index, report.attempt_id)
                        reports.setdefault(key, set()).add(report.state)
                if isinstance(event, LeaderElected):
                    epochs.append(event.epoch)
                state.apply(record.seq, event)
        finally:
            await events.aclose()
        return state, reports, epochs

    def projection_differs(self, state: ClusterState) -> int:
        """Jobs and workers the dashboard shows otherwise than `state` does."""
        differ = 0
        for job_id, job in state.jobs.items():
            shown = self.get(f"/api/jobs/{urllib.parse.quote(job_id, safe='')}")
            differ += shown != as_json(views.job_detail(job))
        workers = {w["worker_id"]: w for w in self.get("/api/workers")}
        for worker_id, worker in state.workers.items():
            expected = as_json(views.worker_out(worker, None, False))
            got = dict(workers.get(worker_id, {}))
            for live_only in ("healthy", "last_heartbeat"):
                expected.pop(live_only, None)
                got.pop(live_only, None)
            differ += got != expected
        return differ

    async def finish(self, timeout: float = 60) -> Counts:
        """Lets every task end, waits (bounded) for every job, then counts."""
        self.stop_file.write_text("stop")
        self.mark("finishing")
        c = self.counts
        ids = {seq: await self.job_of(seq) for seq in self.seqs}
        c.lost = sum(1 for i in ids.values() if i is None)
        known = [i for i in ids.values() if i is not None]

        def every_job_terminal() -> bool:
            return all((j := self.get(f"/api/jobs/{i}")) is not None and j["state"] in TERMINAL
                       for i in known)

        await self.until("every job terminal", every_job_terminal, timeout)
        self.mark("terminal")
        for job_id in known:
            job = self.get(f"/api/jobs/{job_id}")
            if job is None:
                c.lost += 1
            elif job["state"] not in TERMINAL:
                c.not_terminal += 1
            elif job["state"] != "succeeded":
                c.notes.setdefault("not_succeeded", []).append(f"{job_id}:{job['state']}")
        await asyncio.sleep(1)  # the last exits' releases
        report = await self.check()
        c.double_booked = self.max_double_booked
        found = report.violations()
        if self.forged_only is not None:
            if forged := [v for v in found if self.forged_only(v)]:
                c.notes["forged"] = forged[:10]
            found = [v for v in found if not self.forged_only(v)]
        self.checker_seen |= {f"at the end: {v}" for v in found}
        c.checker = len(self.checker_seen)
        if c.checker:
            c.notes["checker"] = sorted(self.checker_seen)[:10]
        self.mark("final check")
        last = await nats_io.last_event_seq(self.bus.jetstream())
        await self.until("the dashboard caught up",
                         lambda: self.get("/healthz")["events_seq"] >= last, 30)
        self.mark("dashboard caught up")
        state, reports, epochs = await self.fold()
        self.mark("folded")
        c.reports_lost, c.reports_twice = attempt_counts(state, reports, set(known))
        c.projection = self.projection_differs(state)
        c.epochs_reused = epochs_reused(epochs)
        c.notes["epochs"] = epochs
        c.two_copies = len(self.sampler.overlap)
        if c.two_copies:
            c.notes["two_copies_s"] = round(self.sampler.longest_overlap(), 1)
        c.notes["retries"] = sum(len(t.attempts) - 1 for i in known if i in state.jobs
                                 for t in state.jobs[i].tasks)
        self.mark("counted")
        return c


Scenario = Callable[[FaultRun], Awaitable[None]]


# --- the scenarios: each does its fault under load; FaultRun.finish counts ----------------

async def _mid_burst(run: FaultRun, long: int = 6, burst: int = 40) -> asyncio.Task[list[int]]:
    """`long` tasks running, and a burst of `burst` short jobs being submitted for half a
    second: the moment a scenario strikes."""
    await run.running(await run.long_jobs(long))
    submitting = asyncio.create_task(run.short_jobs(burst))
    await asyncio.sleep(0.5)
    return submitting


async def leader_killed(run: FaultRun) -> None:
    """SIGKILL of the leader mid-burst, with a standby running; it comes back as a standby."""
    burst = await _mid_burst(run)
    label = await run.signal_leader(signal.SIGKILL)
    await burst
    await run.until("the standby leads", lambda: run.leader_label() not in (None, label), 30)
    run.restart_service("scheduler", label)


async def leader_paused(run: FaultRun) -> None:
    """SIGSTOP of the leader for three lease lifetimes mid-burst, then SIGCONT."""
    burst = await _mid_burst(run)
    label = await run.signal_leader(signal.SIGSTOP)
    await asyncio.sleep(6)
    run.s.children[label].send_signal(signal.SIGCONT)
    await burst


async def submitter_killed(run: FaultRun) -> None:
    """SIGKILL of the submitter mid-burst; a new one starts a second later. What the dead
    one held unacknowledged is redelivered after the consumer's ack wait (30 s)."""
    burst = asyncio.create_task(run.short_jobs(40))
    await asyncio.sleep(0.3)
    run.kill("submitter")
    await asyncio.sleep(1)
    await burst
    run.restart_service("submitter", "submitter")


async def worker_killed(run: FaultRun) -> None:
    """SIGKILL of a worker agent running tasks: its task trees die with it, it is declared
    dead, its tasks run elsewhere; then it starts again as a new incarnation."""
    long = await run.long_jobs(6)
    await run.running(long)
    victim = max((w for w in run.get("/api/workers")),
                 key=lambda w: len(w["running_attempts"]))["worker_id"]
    burst = asyncio.create_task(run.short_jobs(20))
    run.kill(victim)
    await burst
    await run.until("the victim's tasks running elsewhere", lambda: all(
        (j := run.get(f"/api/jobs/{run.job_ids[s]}")) and j["state"] == "running"
        and j["tasks"][0]["attempts"][-1]["worker_id"] != victim for s in long), 30)
    run.restart_service("worker", victim)


async def _nats_restarted(run: FaultRun, burst_size: int = 40) -> None:
    burst = asyncio.create_task(run.short_jobs(burst_size))
    await asyncio.sleep(0.5)
    run.kill_nats()
    await asyncio.sleep(2)
    await asyncio.to_thread(run.start_nats)
    await burst
    await asyncio.sleep(2)
    await run.check_now("after the nats-server restart")


async def nats_restarted(run: FaultRun) -> None:
    """nats-server SIGKILLed mid-burst and started again on its port with its store."""
    await run.running(await run.long_jobs(4))
    await _nats_restarted(run)


async def _valkey_restarted(run: FaultRun, empty: bool, burst_size: int = 30) -> None:
    """valkey kill -9 under running tasks mid-burst, restarted 2 s later; once a new term
    has begun, the checker must find every live attempt's reservation (none freed, none
    missing) and nothing double-booked."""
    terms = await run.elections()
    burst = asyncio.create_task(run.short_jobs(burst_size))
    await asyncio.sleep(0.5)
    run.kill_redis()
    await asyncio.sleep(2)
    await asyncio.to_thread(run.start_redis, empty)
    await burst
    await run.until_new_term(terms)
    await run.check_now("after the valkey restart" + (" (emptied)" if empty else ""))


async def valkey_restarted_aof(run: FaultRun) -> None:
    """valkey kill -9 under running tasks mid-burst, restarted with its AOF."""
    await run.running(await run.long_jobs(6))
    await _valkey_restarted(run, empty=False)


async def valkey_restarted_empty(run: FaultRun) -> None:
    """valkey kill -9 under running tasks, restarted with its data dir emptied: Redis's epoch
    starts at 0 again and every reservation is gone (issue 21)."""
    await run.running(await run.long_jobs(6))
    await _valkey_restarted(run, empty=True)


async def outages(run: FaultRun) -> None:
    """The three server outages one after the other on one stack, each mid-burst under
    running tasks: valkey restarted emptied, nats-server restarted, valkey restarted with
    its AOF (issue 13 item 1, issue 21's emptied Redis)."""
    await run.running(await run.long_jobs(6))
    await _valkey_restarted(run, empty=True, burst_size=20)
    await _nats_restarted(run, burst_size=20)
    await _valkey_restarted(run, empty=False, burst_size=20)


async def gangs_while_leader_dies(run: FaultRun) -> None:
    """A burst of gangs (3 tasks each, one slice of 3 hosts each, a coordinator port) while
    the leader is SIGKILLed."""
    for slice_name in ("a", "b"):
        for i in range(3):
            run.s.start_worker(f"slice-{slice_name}-{i}", 2, 2048, "-a", f"slice={slice_name}")
    await run.until("6 slice workers", lambda: len(run.get("/api/workers")) >= 6, 30)
    burst = asyncio.create_task(run.gang_jobs(6, 3))
    await asyncio.sleep(0.3)
    await run.signal_leader(signal.SIGKILL)
    await burst
    await asyncio.sleep(3)


async def fuzzed(run: FaultRun, payloads: int) -> None:
    """Every decoder and subject fuzzed; then a burst of real jobs must all succeed."""
    run.forged_only = fuzz.forged_only
    long = await run.long_jobs(3)
    await run.running(long)
    sent = await fuzz.send(run.bus, payloads, workers=["local-0", "local-1"], epochs=False)
    run.counts.notes["fuzz_payloads"] = sent
    await run.short_jobs(10)


async def forged_epochs(run: FaultRun) -> None:
    """A `berth.leader` announcement and `leader_elected` events of absurd epochs (10^9,
    10^30), as the admin identity, under running tasks; then more jobs must succeed and
    the leader must stay obeyed (issue 21 item 2)."""
    long = await run.long_jobs(3)
    await run.running(long)
    for subject, payload in fuzz.forged_epochs():
        await run.bus.publish(subject, payload)
    await run.bus.flush()
    run.counts.notes["fuzz_payloads"] = len(fuzz.forged_epochs())
    await asyncio.sleep(1)
    await run.short_jobs(10)


SCENARIOS: dict[str, tuple[Scenario, dict[str, Any]]] = {
    "leader-sigkill": (leader_killed, {}),
    "leader-sigstop": (leader_paused, {}),
    "submitter-sigkill": (submitter_killed, {}),
    "worker-sigkill": (worker_killed, {}),
    "nats-restart": (nats_restarted, {}),
    "valkey-restart-aof": (valkey_restarted_aof, {}),
    "valkey-restart-empty": (valkey_restarted_empty, {}),
    "outages": (outages, {}),
    "gangs-leader-dies": (gangs_while_leader_dies, {"workers": 0}),
    "fuzz-forged-epochs": (forged_epochs, {}),
}
FINISH_TIMEOUT = {"submitter-sigkill": 90.0}


async def run_scenario(name: str, data_dir: Path, fuzz_payloads: int = 100_000,
                       quick: bool = False) -> Counts:
    """One scenario on a fresh stack in `data_dir`, torn down whatever happens. `quick`:
    two workers (where the scenario does not choose) and half the jobs."""
    if name == "fuzz":
        async def scenario(run: FaultRun) -> None:
            await fuzzed(run, fuzz_payloads)
        kw: dict[str, Any] = {"check_every": 0}
    else:
        scenario, kw = SCENARIOS[name]
    if quick:
        kw = {"workers": 2, **kw, "scale": 0.5}
    async with FaultRun(data_dir, name, **kw) as run:
        await scenario(run)
        await run.finish(FINISH_TIMEOUT.get(name, 60))
    return run.counts


ALL = [*SCENARIOS, "fuzz"]
