"""Partition scenarios on the test bed, each bounded and each counting what must read 0:
acknowledged submits lost, jobs not terminal, double-booked hosts (the checker), two live
copies of one task (sampled from /proc), stale commands obeyed, healthy workers declared
dead, services that died. Run by tests/test_partitions.py (the quick form) and by
bench/partitions.py (every scenario, a table).

Tasks run until a stop file appears and carry a unique token in their argv; a sampler
thread reads /proc every 0.1 s and records which attempt of which token is alive on which
worker (BERTH_ATTEMPT_ID, BERTH_WORKER_ID from the process's environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats.errors
from nats.aio.msg import Msg

from berth.client import submit_job
from berth.shared import subjects
from berth.shared.checker import Report as CheckReport
from berth.shared.checker import check_cluster
from berth.shared.messages import (
    JobSpec,
    Resources,
    command_decoder,
    decode,
    event_decoder,
    reports_in,
)
from tests.bed_cluster import HEADERS, BedCluster, start_cluster
from tests.faults.procs import Sampler
from tests.netbed import Bed

# The timings: heartbeat 0.5 s, dead-after 3 s, lease TTL 2 s (fence margin 1 s).
ENV = {"BERTH_HEARTBEAT_INTERVAL": "0.5", "BERTH_WORKER_DEAD_AFTER": "3",
       "BERTH_LEASE_TTL": "2", "BERTH_KILL_GRACE": "2", "BERTH_TICK_INTERVAL": "0.2"}
WORKERS = ["w1", "w2", "w3"]
HOSTS = ["nats", "redis", "svc", "ctl", "ctl2", *WORKERS]
TERMINAL = {"succeeded", "failed", "killed", "unschedulable"}
TOKEN = "bedtok"
# Runs until the stop file appears, or until the wall-clock time in its own end file
# (`Run.end_at`) passes; once it ends on its own it adds a line (token, attempt, worker) to
# the run's completions file, so a command that ran to completion twice is seen.
TASK = """
import os, sys, time
stop, token = sys.argv[1], sys.argv[2]
while not os.path.exists(stop):
    try:
        with open(f"{stop}.{token}.end") as f:
            if time.time() >= float(f.read()):
                break
    except (OSError, ValueError):
        pass
    time.sleep(0.1)
with open(f"{stop}.completed", "a") as f:
    f.write(f"{token} {os.environ['BERTH_ATTEMPT_ID']} {os.environ['BERTH_WORKER_ID']}\\n")
"""
# When the cut-off worker's tasks end on their own, in seconds from the cut (the worker
# fences at D - M = 2 s after its last answered heartbeat, so no later than 2 s into the
# cut, and is declared dead at D = 3 s after the leader last heard it). Before the fence:
# the task is done, its report waits for the heal (and its retry runs it again: nobody
# could know). After the fence, before and after the verdict: the fence must have killed
# it, so it never completes there.
ENDS = {"before_fence": 0.5, "after_fence": 2.6, "after_verdict": 5.0}
CHECK_TRIES = 5
# Retries are read job by job (its detail): skipped past this many jobs.
RETRIES_READ_UP_TO = 20


# What a Result counts; every one must read 0.
COUNTS = ("lost", "not_terminal", "double_booked", "two_copies", "stale_obeyed", "wrong_deaths",
          "disagreements", "minority_acks", "epoch_regressions", "reservations_lost",
          "port_collisions", "unreached", "completed_twice", "applied_twice")


@dataclass
class Result:
    scenario: str
    acked: int = 0
    lost: int = 0
    not_terminal: int = 0
    double_booked: int = 0         # hosts, (address, port) pairs and devices, by the checker
    two_copies: int = 0            # tasks seen with two attempts alive at once
    two_copies_s: float = 0.0      # the longest such overlap, seconds
    stale_obeyed: int = 0          # commands of a deposed epoch not refused by the worker
    wrong_deaths: int = 0          # workers declared dead that were not cut off
    disagreements: int = 0         # Redis and the log's fold disagree once all is done
    minority_acks: int = 0         # writes a NATS node cut off from its quorum acknowledged
    epoch_regressions: int = 0     # leaders elected with an epoch not above every earlier
    reservations_lost: int = 0     # running attempts whose reservation a failover lost
    port_collisions: int = 0       # tasks that could not bind the named port they were given
    unreached: int = 0             # gang members that could not reach their coordinator
    completed_twice: int = 0       # tasks due to end after their fence that completed twice
    applied_twice: int = 0         # tasks shown succeeded twice, or an attempt a verdict
                                   # wrote off shown succeeded (a late report applied)
    died: list[str] = field(default_factory=list)
    # Measured, not judged: seconds from the cut unless said otherwise.
    notes: dict[str, Any] = field(default_factory=dict)

    def violations(self) -> list[str]:
        out = [f"{name}={getattr(self, name)}" for name in
               COUNTS if getattr(self, name)]
        if self.died:
            out.append(f"died={self.died}")
        return out


class Bus:
    """What the test hears on the bus (through the NATS portal, never cut): commands and
    their epochs, leader elections, death verdicts."""

    def __init__(self) -> None:
        self.commands: list[tuple[float, str, int, str]] = []  # (t, worker, epoch, kind)
        self.elected: list[tuple[float, int]] = []
        self.deaths: list[tuple[float, str]] = []
        # (t, worker, job, task, attempt, state) of every attempt report stored
        self.reports: list[tuple[float, str, str, int, int, str]] = []

    async def listen(self, nc: Any) -> None:
        async def command(msg: Msg) -> None:
            with contextlib.suppress(Exception):
                cmd = decode(command_decoder, msg.data)
                self.commands.append((time.monotonic(), msg.subject.split(".")[2], cmd.epoch,
                                      type(cmd).__name__))

        async def elected(msg: Msg) -> None:
            with contextlib.suppress(Exception):
                self.elected.append((time.monotonic(), int(json.loads(msg.data)["epoch"])))

        async def death(msg: Msg) -> None:
            with contextlib.suppress(Exception):
                self.deaths.append((time.monotonic(), json.loads(msg.data)["worker_id"]))

        async def report(msg: Msg) -> None:
            with contextlib.suppress(Exception):
                self.reports += [(time.monotonic(), r.worker_id, r.job_id, r.task_index,
                                  r.attempt_id, r.state.name)
                                 for r in reports_in(decode(event_decoder, msg.data))]

        await nc.subscribe(subjects.worker_commands("*"), cb=command)
        await nc.subscribe(subjects.attempt_reports("*"), cb=report)
        await nc.subscribe(subjects.LEADER_EVENTS, cb=elected)
        await nc.subscribe(subjects.worker_verdicts("*"), cb=death)


class Run:
    """One scenario's cluster, jobs and observers."""

    def __init__(self, cluster: BedCluster, name: str, via: str | None = None) -> None:
        self.cluster = cluster
        self.via = via  # the NATS host the test's connection goes to
        self.bed: Bed = cluster.bed
        self.result = Result(name)
        self.tag = f"{TOKEN}-{uuid.uuid4().hex[:8]}"
        self.stop_file = cluster.data_dir / f"stop-{self.tag}"
        self.sampler = Sampler(self.tag)
        self.bus = Bus()
        self.jobs: dict[str, str] = {}  # job id -> token
        self.nc: Any = None
        self.max_double_booked = 0
        self.report: CheckReport | None = None
        self.started = time.monotonic()
        self.submitted = 0
        self.marks: dict[str, float] = {}

    async def __aenter__(self) -> Run:
        self.nc = await self.cluster.admin(self.via)
        await self.bus.listen(self.nc)
        self.sampler.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.sampler.stop()
        with contextlib.suppress(Exception):
            await self.nc.close()

    async def submit(self, n: int, cpu: float = 0.5) -> list[str]:
        ids = []
        for _ in range(n):
            self.submitted += 1
            token = f"{self.tag}-{self.submitted}"
            spec = JobSpec(name=token, command=["python3", "-c", TASK, str(self.stop_file),
                                                token],
                           resources=Resources(cpu=cpu, memory_mb=32))
            outcome = await submit_job(self.nc, spec, timeout=30)
            if outcome.accepted:
                self.result.acked += 1
                ids.append(str(outcome.job_id))
                self.jobs[str(outcome.job_id)] = token
        return ids

    def end_at(self, token: str, when: float) -> None:
        """Task `token` ends on its own at wall-clock time `when` (written whole: a task
        reads it every 0.1 s)."""
        path = Path(f"{self.stop_file}.{token}.end")
        part = path.with_suffix(".part")
        part.write_text(repr(when))
        part.rename(path)

    def completions(self) -> dict[str, list[tuple[str, str]]]:
        """Token -> (attempt, worker) of each time its command ran to completion."""
        path = Path(f"{self.stop_file}.completed")
        done: dict[str, list[tuple[str, str]]] = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            token, attempt, worker = line.split()
            done.setdefault(token, []).append((attempt, worker))
        return done

    def job(self, job_id: str) -> dict[str, Any] | None:
        resp = httpx.get(f"{self.cluster.api_url}/api/jobs/{job_id}", timeout=10,
                         headers=HEADERS)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    def states(self) -> dict[str, str]:
        """Every job of this run (by its name's tag) -> its state, in one listing."""
        got: dict[str, str] = {}
        cursor = None
        while True:
            params = {"name_prefix": self.tag, "limit": "1000",
                      **({"cursor": cursor} if cursor else {})}
            resp = httpx.get(f"{self.cluster.api_url}/api/jobs", params=params, timeout=10,
                             headers=HEADERS)
            resp.raise_for_status()
            page = resp.json()
            got.update((j["job_id"], j["state"]) for j in page["jobs"])
            cursor = page.get("next_cursor")
            if not cursor:
                return got

    def workers(self) -> list[dict[str, Any]]:
        got = self.cluster.get("/api/workers")
        assert isinstance(got, list)
        return got

    async def until(self, what: str, predicate: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if got := predicate():
                    return got
            await asyncio.sleep(0.2)
        self.result.notes.setdefault("timeouts", []).append(what)
        return None

    def running(self, ids: list[str]) -> bool:
        """Whether every one of `ids` runs, read in one listing: a job's detail each took a
        full pass of 20-odd requests, which on a loaded machine added seconds to what the
        scenarios measure (a Redis failover's "every job placed after the heal")."""
        states = self.states()
        return all(states.get(i) == "running" for i in ids)

    async def check(self) -> None:
        """The checker, as `berth doctor` runs it; asked again while NATS is electing (a
        cluster that just lost or regained a node answers nothing for a moment)."""
        js = self.nc.jetstream()
        for tries_left in range(CHECK_TRIES - 1, -1, -1):
            store = self.cluster.store()
            try:
                report = await check_cluster(js, store)
                break
            except (nats.errors.Error, TimeoutError):
                if not tries_left:
                    self.result.notes["checks_unanswered"] = (
                        self.result.notes.get("checks_unanswered", 0) + 1)
                    return
                await asyncio.sleep(1)
            finally:
                await store.client.aclose()
        self.max_double_booked = max(self.max_double_booked,
                                     report.double_booked_hosts + report.double_booked_ports
                                     + report.double_booked_devices)
        self.report = report

    async def finish(self, timeout: float = 45) -> Result:
        """Lets every task end, waits for every job, then counts."""
        self.stop_file.write_text("stop")
        await self.until("every job terminal", lambda: all(
            states.get(i) in TERMINAL for states in [self.states()] for i in self.jobs),
            timeout)
        await asyncio.sleep(1)
        await self.check()
        r = self.result
        states = self.states()
        for job_id in self.jobs:
            state = states.get(job_id)
            if state is None:
                r.lost += 1
            elif state not in TERMINAL:
                r.not_terminal += 1
                # Which stage they are stuck in: never placed, placed and never started, ...
                stuck = r.notes.setdefault("not_terminal_in", {})
                stuck[state] = stuck.get(state, 0) + 1
            elif state != "succeeded":
                r.notes.setdefault("not_succeeded", []).append(f"{job_id}:{state}")
        r.double_booked = self.max_double_booked
        if self.report is not None:
            disagree = (self.report.reservations_without_attempt
                        + self.report.attempts_without_reservation)
            r.disagreements = len(disagree)
            # Which way: a reservation no live attempt holds, or a live attempt without one.
            for way in ("reservations_without_attempt", "attempts_without_reservation"):
                if found := getattr(self.report, way):
                    r.notes[way] = found[:3]
        r.two_copies = len(self.sampler.overlap)
        r.two_copies_s = round(self.sampler.longest_overlap(), 1) if r.two_copies else 0.0
        if r.two_copies:  # which attempts, where, and when (from the start of the run)
            r.notes["overlaps"] = {
                tok: sorted((w, a, round(v[0] - self.started, 1), round(v[1] - self.started, 1))
                            for (t, w, a), v in self.sampler.seen.items() if t == tok)
                for tok in self.sampler.overlap}
        r.died = self.cluster.died()
        r.notes["resets"] = sum(1 for c in self.bus.commands if c[3] == "ResetWorker")
        if len(self.jobs) <= RETRIES_READ_UP_TO:
            r.notes["retries"] = sum(
                max(0, len(t["attempts"]) - 1) for i in self.jobs
                for t in (self.job(i) or {"tasks": []})["tasks"])
        return r


def _where(run: Run, worker: str) -> list[str]:
    """Tokens whose (live) attempt runs on `worker`, by the sampler."""
    return sorted({tok for tok, w, _ in run.sampler.sample() if w == worker})


async def worker_cut(cluster: BedCluster, mode: str, cut: float) -> Result:
    """A worker host cut off from the NATS host (both ways, or one way) for `cut` seconds
    while running tasks: its tasks must be stopped by its own fence before their retries
    start elsewhere, and after the heal it rejoins as a new incarnation."""
    async with Run(cluster, f"worker cut from NATS, {mode}, {cut:g} s") as run:
        # 9 on 3 workers: the victim runs at least 3, one for each of ENDS.
        ids = await run.submit(9)
        await run.until("9 running", lambda: run.running(ids), 30)
        by_worker = {w["worker_id"]: w for w in run.workers()}
        # Each worker advertises its own host's address, as tasks on other hosts reach it.
        run.result.notes["addresses_advertised"] = all(
            by_worker[w]["address"] == run.bed.address(w) for w in WORKERS)
        victim = max(WORKERS, key=lambda w: len(by_worker[w]["running_attempts"]))
        old_incarnation = by_worker[victim]["incarnation"]
        victims = _where(run, victim)
        run.result.notes["victim_tasks"] = len(victims)
        # Each of the victim's tasks ends on its own during the cut, in turn before its
        # fence, after it, and after the verdict.
        ends = dict(zip(victims, itertools.cycle(ENDS), strict=False))
        if mode == "both":
            run.bed.partition([victim], ["nats"])
        elif mode == "worker->nats":
            run.bed.partition([victim], ["nats"], oneway=True)
        else:
            run.bed.partition(["nats"], [victim], oneway=True)
        cut_at = time.monotonic()
        cut_wall = time.time()
        for token, when in ends.items():
            run.end_at(token, cut_wall + ENDS[when])
        await asyncio.sleep(min(1.0, cut / 4))
        await run.submit(2)  # acknowledged during the cut
        await asyncio.sleep(max(0.0, cut_at + cut / 2 - time.monotonic()))
        await run.check()
        await asyncio.sleep(max(0.0, cut_at + cut - time.monotonic()))
        run.bed.heal()
        healed = time.monotonic()

        def rejoined() -> bool:
            w = next(w for w in run.workers() if w["worker_id"] == victim)
            return bool(w["healthy"] and w["incarnation"] != old_incarnation)

        back = await run.until(f"{victim} rejoined", rejoined, 30)
        run.result.notes["rejoined_after_heal_s"] = (
            round(time.monotonic() - healed, 1) if back else None)
        await run.check()
        rejoined_at = time.monotonic()
        result = await run.finish()
        # Late heartbeats, resets and verdicts after the heal: heard for 2 s at least after
        # the rejoin (finish's wait for every job takes most of that).
        await asyncio.sleep(max(0.0, rejoined_at + 2 - time.monotonic()))
        # When the victim's old copies died, and when their retries started, from the cut.
        gone = [v[1] for (tok, w, _), v in run.sampler.seen.items()
                if tok in victims and w == victim and v[0] < cut_at]
        retried = [v[0] for (tok, w, _), v in run.sampler.seen.items()
                   if tok in victims and v[0] > cut_at]
        run.result.notes["old_copies_gone_s"] = round(max(gone) - cut_at, 1) if gone else None
        run.result.notes["first_retry_s"] = round(min(retried) - cut_at, 1) if retried else None
        run.result.wrong_deaths = sum(1 for _, w in run.bus.deaths if w != victim)
        _count_ends_in_cut(run, victim, ends, healed)
        return result


def _count_ends_in_cut(run: Run, victim: str, ends: dict[str, str],
                       healed: float) -> None:
    """What became of the victim's tasks that ended on their own during the cut: how often
    each command ran to completion, which reports arrived after the heal, and whether the
    dashboard shows any task succeeded twice or a written-off attempt succeeded."""
    r = run.result
    done = run.completions()
    runs = {kind: [len(done.get(tok, [])) for tok, k in ends.items() if k == kind]
            for kind in ENDS}
    # Per end, how many times each such task's command ran to completion.
    r.notes["ends_in_cut"] = {kind: n for kind, n in runs.items() if n}
    # Done before its fence: its retry runs it again, as nothing could tell the leader.
    r.notes["reran_after_ending"] = sum(1 for n in runs["before_fence"] if n > 1)
    r.completed_twice = sum(1 for kind in ("after_fence", "after_verdict")
                            for n in runs[kind] if n > 1)
    # Attempts whose end the victim reported after the heal (each publish is heard, its
    # retries too: counted once).
    r.notes["late_reports"] = len({(job, task, attempt) for t, worker, job, task, attempt, state
                                   in run.bus.reports if worker == victim and t > healed
                                   and state in ("SUCCEEDED", "FAILED", "KILLED")})
    for job_id, token in run.jobs.items():
        if token not in ends:
            continue
        attempts = [a for t in (run.job(job_id) or {"tasks": []})["tasks"]
                    for a in t["attempts"]]
        succeeded = [a for a in attempts if a["state"] == "succeeded"]
        if len(succeeded) > 1 or any(a["worker_failure"] for a in succeeded):
            r.applied_twice += 1
            r.notes.setdefault("applied_twice_attempts", []).append(attempts)


async def leader_cut(cluster: BedCluster, server: str, cut: float,
                     schedulers: tuple[str, ...] = ("ctl",)) -> Result:
    """The leader's host cut off from Redis or from NATS (both ways), the standby's not; or
    (schedulers=both hosts) Redis cut off from both schedulers, after which they resume."""
    who = "leader" if schedulers == ("ctl",) else "both schedulers"
    async with Run(cluster, f"{who} cut from {server}, {cut:g} s") as run:
        ids = await run.submit(4)
        await run.until("4 running", lambda: run.running(ids), 30)
        old_epoch = max(e for _, e in run.bus.elected) if run.bus.elected else None
        if old_epoch is None:  # elected before we listened: read it from the log
            msg = await run.nc.jetstream().get_last_msg(subjects.EVENTS_STREAM,
                                                        subjects.LEADER_EVENTS)
            old_epoch = int(json.loads(msg.data)["epoch"])
        run.bed.partition(schedulers, [server])
        cut_at = time.monotonic()
        await asyncio.sleep(0.5)
        probe = await run.submit(1)

        def probe_running() -> bool:
            return run.running(probe)

        # Waited for no longer than the cut: where no scheduler can place (both cut from
        # Redis), the former wait of cut + 8 s stretched a 12 s cut to ~22 s, which read as
        # a leader returning 10 s after the heal when it returned ~1 s after it.
        placed = await run.until("the probe job running", probe_running,
                                 max(0.0, cut_at + cut - time.monotonic()))
        run.result.notes["probe_placed_s"] = (
            round(time.monotonic() - cut_at, 1) if placed else None)
        await asyncio.sleep(max(0.0, cut_at + cut - time.monotonic()))
        await run.check()
        # From the heal's start: it lifts each host's rules in turn, the last ones later.
        healed = time.monotonic()
        run.bed.heal()
        run.result.notes["cut_s"] = round(healed - cut_at, 1)
        run.result.notes["heal_took_s"] = round(time.monotonic() - healed, 2)
        result = await run.finish()
        # What the cut-off leader buffered arrives after the heal: heard for 5 s at least
        # (finish's wait for every job takes most of that).
        await asyncio.sleep(max(0.0, healed + 5 - time.monotonic()))
        new = [(t, e) for t, e in run.bus.elected if e > old_epoch]
        run.result.notes["take_over_s"] = round(new[0][0] - cut_at, 1) if new else None
        if new and new[0][0] > healed:
            run.result.notes["take_over_after_heal_s"] = round(new[0][0] - healed, 1)
        if new:
            taken = new[0][0]
            stale = [c for c in run.bus.commands if c[0] >= taken and c[2] <= old_epoch]
            refused = sum(cluster.log(w).count("refusing command") for w in WORKERS)
            run.result.notes["stale_commands_heard"] = len(stale)
            run.result.notes["stale_commands_refused"] = refused
            run.result.stale_obeyed = max(0, len(stale) - refused)
        else:
            run.result.notes["standby_took_over"] = False
        run.result.wrong_deaths = len(run.bus.deaths)
        leader = cluster.services["scheduler-a"][1]
        run.result.notes["old_leader_alive"] = leader.poll() is None
        return result


Scenario = Callable[[BedCluster], Awaitable[Result]]


# The tests' cut; bench/partitions.py --cut sets its own.
DEFAULT_CUT = 8.0


def scenarios(cut: float = DEFAULT_CUT) -> dict[str, Scenario]:
    """Every scenario, each cutting for `cut` seconds (longer than the dead-after time)."""
    return {
        "worker-both": lambda c: worker_cut(c, "both", cut),
        "worker->nats": lambda c: worker_cut(c, "worker->nats", cut),
        "nats->worker": lambda c: worker_cut(c, "nats->worker", cut),
        "leader-redis": lambda c: leader_cut(c, "redis", cut),
        "leader-nats": lambda c: leader_cut(c, "nats", cut),
        "schedulers-redis": lambda c: leader_cut(c, "redis", cut, ("ctl", "ctl2")),
    }


QUICK = ["worker-both", "leader-nats"]


async def run_scenario(name: str, data_dir: Path,
                       scenario: Scenario | None = None) -> Result:
    """A fresh bed and cluster for one scenario, torn down whatever happens."""
    with Bed(HOSTS) as bed:
        cluster = start_cluster(bed, data_dir, WORKERS, ENV, api_host="svc")
        return await (scenario or scenarios()[name])(cluster)
