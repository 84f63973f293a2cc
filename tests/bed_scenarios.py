"""The multi-host scenarios of the test bed beyond a worker's or a leader's cut (those are in
tests/partitions.py, whose Run and Result these reuse, so each counts the same things):

- `nats_minority`: one NATS node of three cut off from the other two (its routes) during a
  burst of submits, then healed. Every submit acknowledged must become a job that ends;
  a node without its quorum must acknowledge nothing (the test publishes through it too).
- `redis_failover`: the Redis primary cut off from its replica and the Sentinels (the
  schedulers still reach it) during placement, Sentinel promoting the replica: no leader
  elected twice with one epoch, no reservation of a running attempt lost, placement resumes.
  `redis-isolated`: the same with the primary cut off from every host, the schedulers too
  (they must follow the Sentinels to the promoted replica).
- `hosts`: a gang spread over four hosts, whose members connect over TCP to the coordinator
  address they were given (task 0 binds it: only its own host owns that address), and
  named ports on an address two workers share, bound for real by the tasks.
- `delayed_worker`: one worker's NATS link through a relay that holds every chunk back.
- `lossy_link`: one worker's packets to and from NATS lost at random (15% each way), or the
  leader's to and from NATS and Redis: no verdict on a worker unless its heartbeats really
  stopped reaching NATS for longer than D.

`QUICK` are the forms tests/test_bed_scenarios.py runs; bench/partitions.py runs them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import redis as sync_redis

from berth.client import publish_submit, wait_for_outcome
from berth.shared import redis_keys, subjects
from berth.shared.messages import Constraint, Coscheduling, JobSpec, Op, Resources, encode
from tests.bed_cluster import NATS_CLUSTER_PORT, BedCluster, Layout, start_cluster
from tests.netbed import Bed
from tests.partitions import ENV, TERMINAL, Result, Run

CTL = {"api": "svc", "schedulers": ("ctl", "ctl2")}
WORKERS3 = {w: w for w in ("w1", "w2", "w3")}
NATS3 = ("n1", "n2", "n3")
SUBMIT_CONCURRENCY = 16


def _layout_nats3() -> Layout:
    return Layout(dict(WORKERS3), nats=NATS3, redis="redis", api="svc",
                  schedulers=("ctl", "ctl2"))


def _layout_sentinel() -> Layout:
    # Two replicas: the promoted one still has a replica to acknowledge fenced writes (with
    # one, placement waits for the old primary to come back as a replica).
    return Layout(dict(WORKERS3), redis="r1", replicas=("r2", "r3"),
                  sentinels=("s1", "s2", "s3"),
                  api="svc", schedulers=("ctl", "ctl2"))


# Four hosts, one gang worker each (a tpu-name slice ordered by tpu-worker-id); a fifth
# worker shares g1's host (and address), both of them in the `pair` the port job asks for.
def _layout_hosts() -> Layout:
    workers = {"g1a": "g1", "g1b": "g1", "g2a": "g2", "g3a": "g3", "g4a": "g4"}
    attributes: dict[str, tuple[str, ...]] = {
        f"g{i}a": ("tpu-name=slice", f"tpu-worker-id={i - 1}") for i in range(1, 5)}
    attributes["g1a"] += ("pair=g1",)
    attributes["g1b"] = ("pair=g1",)
    # g4a's link to NATS is slow (200 ms each way): a gang member on it still takes part.
    return Layout(workers, api="ctl", schedulers=("ctl",), attributes=attributes,
                  delayed={"g4a": 0.2})


def _layout_workers3() -> Layout:
    return Layout(dict(WORKERS3), api="svc", schedulers=("ctl", "ctl2"))


# --- task programs --------------------------------------------------------------------------

# Gang member: task 0 binds the coordinator address it was given (which only its own host
# owns) and waits for every other member; the others connect to it over TCP and say who
# they are. Exit 3: the coordinator address could not be bound; 4: never reached.
GANG = """
import os, socket, sys, time
host, port = os.environ["BERTH_COORDINATOR_ADDRESS"].rsplit(":", 1)
me, n = int(os.environ["BERTH_TASK_INDEX"]), int(os.environ["BERTH_NUM_TASKS"])
deadline = time.monotonic() + 40
if me == 0:
    try:
        server = socket.create_server((host, int(port)))
    except OSError as exc:
        print("cannot bind", host, port, exc, flush=True); sys.exit(3)
    server.settimeout(1)
    heard = set()
    while len(heard) < n - 1 and time.monotonic() < deadline:
        try:
            conn, peer = server.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(5)
            heard.add(conn.recv(64).decode())
            conn.sendall(b"ok")
    print("heard", sorted(heard), flush=True)
    sys.exit(0 if len(heard) == n - 1 else 4)
while time.monotonic() < deadline:
    try:
        with socket.create_connection((host, int(port)), timeout=2) as conn:
            conn.sendall(f"{me}@{os.environ['BERTH_HOST_ADDRESS']}".encode())
            if conn.recv(8) == b"ok":
                sys.exit(0)
    except OSError:
        time.sleep(0.2)
print("never reached", host, port, flush=True)
sys.exit(4)
"""
UNREACHED_EXIT = {3, 4}

# Binds its named port on its host's address (no SO_REUSEADDR from another socket can
# share it) and holds it until the stop file appears. Exit 5: the port was taken.
PORT_HOLDER = """
import os, socket, sys, time
address, port = os.environ["BERTH_HOST_ADDRESS"], int(os.environ["BERTH_PORT_HTTP"])
try:
    server = socket.create_server((address, port))
except OSError as exc:
    print("port taken", address, port, exc, flush=True); sys.exit(5)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
"""
COLLISION_EXIT = 5


def _exit_codes(run: Run, job_id: str) -> list[int]:
    """Every attempt's exit code of every task of a job (as the dashboard shows them)."""
    job = run.job(job_id) or {}
    return [int(a["exit_code"]) for t in job.get("tasks", []) for a in t.get("attempts", [])
            if a.get("exit_code") is not None]


# --- one NATS node of three cut off ---------------------------------------------------------


async def _stream_leader(run: Run, stream: str) -> str | None:
    """The host whose node leads `stream` (None while it elects one, or NATS is silent)."""
    try:
        info = await run.nc.jetstream().stream_info(stream)
    except (nats.errors.Error, TimeoutError):
        return None
    name = info.cluster.leader if info.cluster else None
    return NATS3[int(name.rsplit("n", 1)[1]) - 1] if name else None  # berth-n<i> -> n<i>


async def nats_minority(bed: Bed, data_dir: Path, submits: int, cut: float) -> Result:
    cluster = start_cluster(bed, data_dir, _layout_nats3(), ENV)
    # The node leading the submit stream is the one cut off: its stream must elect another
    # leader on the majority side, while the submits keep coming.
    probe = Run(cluster, "probe", via=NATS3[0])
    async with probe:
        for _ in range(50):
            if victim := await _stream_leader(probe, subjects.SUBMIT_STREAM):
                break
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError("the submit stream has no leader")
    majority = [h for h in NATS3 if h != victim]
    routes_tls = _routes_need_tls(bed, NATS3)
    async with Run(cluster, f"NATS node cut from the other two, {submits} submits, "
                            f"{cut:g} s", via=majority[0]) as run:
        minority_nc = await cluster.admin(via=victim)
        outcomes: dict[str, int] = {"acked": 0, "acked_sent_in_cut": 0, "refused": 0,
                                    "puback_no_outcome": 0, "minority_tries": 0}
        cut_at: list[float] = []
        sem = asyncio.Semaphore(SUBMIT_CONCURRENCY)

        async def one(i: int, nc: Any, minority: bool, after: float = 0.0) -> None:
            await asyncio.sleep(after)
            spec = JobSpec(name=f"{run.tag}-{i}", command=["true"],
                           resources=Resources(cpu=0.1, memory_mb=16))
            async with sem:
                sent_at = time.monotonic()
                try:
                    seq = await asyncio.wait_for(
                        publish_submit(nc, encode(spec), subject=subjects.submit_job(None)),
                        5)
                except (TimeoutError, nats.errors.Error, nats.js.errors.Error):
                    outcomes["refused"] += 1
                    return
                if minority and cut_at and sent_at > cut_at[0] and not healed.is_set():
                    # Acknowledged by a node that cannot reach its quorum.
                    run.result.minority_acks += 1
                try:
                    outcome = await wait_for_outcome(nc if not minority else run.nc, seq,
                                                     timeout=60)
                except TimeoutError:
                    outcomes["puback_no_outcome"] += 1
                    return
            if outcome.accepted:
                outcomes["acked"] += 1
                if cut_at and sent_at > cut_at[0]:
                    outcomes["acked_sent_in_cut"] += 1
                run.result.acked += 1
                run.jobs[str(outcome.job_id)] = spec.name

        healed = asyncio.Event()
        # Spread over the cut and a second either side, so it goes on through the cut.
        spread = (cut + 2) / submits
        tasks = [asyncio.create_task(one(i, run.nc, False, i * spread))
                 for i in range(submits)]
        await asyncio.sleep(1)
        bed.partition([victim], majority)
        cut_at.append(time.monotonic())
        run.result.notes["cut_node"] = victim
        run.result.notes["routes_tls"] = routes_tls
        # Writes through the cut-off node, while the burst goes on through the majority.
        minority: list[asyncio.Task[None]] = []
        while time.monotonic() < cut_at[0] + cut:
            outcomes["minority_tries"] += 1
            minority.append(asyncio.create_task(one(10**6 + len(minority), minority_nc,
                                                    True)))
            await asyncio.sleep(0.5)
        await run.check()
        healed.set()
        bed.heal()
        run.result.notes["healed_after_burst"] = sum(t.done() for t in tasks)
        await asyncio.gather(*tasks, *minority)
        run.result.lost += outcomes["puback_no_outcome"]
        run.result.notes.update(outcomes)
        run.result.notes["submit_leader_after"] = await _stream_leader(run,
                                                                       subjects.SUBMIT_STREAM)
        await minority_nc.close()
        return await run.finish(timeout=90)


# --- the Redis primary cut off from its replica and the Sentinels ---------------------------


class EpochWatch:
    """The fencing epoch every 0.1 s: on the node the Sentinels name primary at that moment
    (what a scheduler that asks now is fenced by), and on each data node (read as admin
    through portals)."""

    def __init__(self, cluster: BedCluster) -> None:
        self.cluster = cluster
        self.primary: list[int] = []
        self.seen: dict[str, list[int]] = {}
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        clients = {h: sync_redis.Redis.from_url(self.cluster.redis_url_via(h), socket_timeout=1)
                   for h in self.cluster.redis_portals}
        while not self.halt.is_set():
            with contextlib.suppress(Exception):
                primary = self.cluster.primary_host()
            for host, client in clients.items():
                with contextlib.suppress(sync_redis.RedisError):
                    value = client.get(redis_keys.EPOCH)
                    if value is not None:
                        self.seen.setdefault(host, []).append(int(value))
                        if host == primary:
                            self.primary.append(int(value))
            self.halt.wait(0.1)
        for client in clients.values():
            client.close()

    def regressions(self) -> int:
        """Times the primary's epoch went down (a promoted replica lacking a write that a
        leader was elected by)."""
        return sum(1 for a, b in itertools.pairwise(self.primary) if b < a)

    def discarded(self) -> int:
        """Times a node's own epoch went down: the old primary's unacknowledged increments,
        dropped when it comes back as a replica (no leader ever used them)."""
        return sum(1 for values in self.seen.values()
                   for a, b in itertools.pairwise(values) if b < a)


async def redis_failover(bed: Bed, data_dir: Path, cut: float, isolate: bool = False
                         ) -> Result:
    """The primary cut from its replicas and Sentinels (the schedulers still reach it), or
    (`isolate`) from every other host, the schedulers too."""
    cluster = start_cluster(bed, data_dir, _layout_sentinel(), ENV)
    layout = cluster.layout
    watch = EpochWatch(cluster)
    watch.thread.start()
    whom = "everyone" if isolate else "replica and Sentinels"
    try:
        async with Run(cluster, f"Redis primary cut from {whom}, {cut:g} s") as run:
            ids = await run.submit(4)
            await run.until("4 running", lambda: run.running(ids), 30)
            old = layout.redis
            if isolate:
                bed.isolate(old)
            else:
                bed.partition([old], [*layout.replicas, *layout.sentinels])
            cut_at = time.monotonic()
            # Placement goes on through the cut: a job every half second.
            later: list[str] = []
            first_placed = None
            while time.monotonic() < cut_at + cut:
                later += await run.submit(1, cpu=0.1)
                if first_placed is None and any(run.running([i]) for i in later):
                    first_placed = round(time.monotonic() - cut_at, 1)
                await asyncio.sleep(0.5)
            run.result.notes["placed_during_cut_s"] = first_placed
            run.result.notes["promoted"] = cluster.primary_host()
            bed.heal()
            healed = time.monotonic()
            placed = await run.until("every later job running",
                                     lambda: run.running(later), 30)
            run.result.notes["all_placed_after_heal_s"] = (
                round(time.monotonic() - healed, 1) if placed else None)
            await asyncio.sleep(2)
            await run.check()  # tasks still running: each must still hold its reservation
            if run.report is not None:
                run.result.reservations_lost = len(run.report.attempts_without_reservation)
            elected = [e for _, e in run.bus.elected]
            taken = [t for t, _ in run.bus.elected if t > cut_at]
            run.result.notes["take_over_s"] = round(taken[0] - cut_at, 1) if taken else None
            run.result.epoch_regressions = watch.regressions() + sum(
                1 for a, b in itertools.pairwise(elected) if b <= a)
            run.result.notes["elected"] = elected
            run.result.notes["unacked_epochs_discarded"] = watch.discarded()
            return await run.finish()
    finally:
        watch.halt.set()
        watch.thread.join()


# --- a gang over four hosts, and named ports on a shared address ----------------------------


async def hosts(bed: Bed, data_dir: Path, port_tasks: int) -> Result:
    cluster = start_cluster(bed, data_dir, _layout_hosts(), ENV)
    async with Run(cluster, f"gang over 4 hosts, {port_tasks} port holders on a shared "
                            "address") as run:
        gang = JobSpec(name=f"{run.tag}-gang", command=["python3", "-c", GANG], replicas=4,
                       resources=Resources(cpu=0.5, memory_mb=32),
                       coscheduling=Coscheduling(group_by="tpu-name",
                                                 order_by="tpu-worker-id"),
                       ports=["coordinator"], max_retries_failure=0)
        holders = JobSpec(name=f"{run.tag}-ports", replicas=port_tasks,
                          command=["python3", "-c", PORT_HOLDER, str(run.stop_file)],
                          resources=Resources(cpu=0.25, memory_mb=16), ports=["http"],
                          constraints=[Constraint(key="pair", op=Op.EQ, value="g1")])
        spread = JobSpec(name=f"{run.tag}-spread", replicas=port_tasks,
                         command=["python3", "-c", PORT_HOLDER, str(run.stop_file)],
                         resources=Resources(cpu=0.25, memory_mb=16), ports=["http"])
        ids = {}
        for spec in (gang, holders, spread):
            outcome = await _submit(run, spec)
            ids[spec.name] = outcome
        gang_id = ids[gang.name]
        done = await run.until("the gang done", lambda: (j := run.job(gang_id)) is not None
                               and j["state"] in TERMINAL, 60)
        job = run.job(gang_id) or {}
        workers = [a["worker_id"] for t in job.get("tasks", []) for a in t["attempts"]]
        run.result.notes["gang_state"] = job.get("state")
        run.result.notes["gang_hosts"] = sorted({cluster.layout.workers[w] for w in workers})
        run.result.unreached = sum(1 for c in _exit_codes(run, gang_id) if c in UNREACHED_EXIT)
        if not done or job.get("state") != "succeeded":
            run.result.unreached = max(run.result.unreached, 1)
        await run.until("the port holders running",
                        lambda: run.running([ids[holders.name], ids[spread.name]]), 30)
        holding = run.job(ids[holders.name]) or {}
        run.result.notes["pair_workers"] = sorted(
            {a["worker_id"] for t in holding.get("tasks", []) for a in t["attempts"]})
        await run.check()
        # valkey runs berth's ACL: without credentials nothing gets in.
        run.result.notes["anonymous_refused"] = _refuses_anonymous(
            cluster.redis_portals[cluster.layout.redis])
        # NATS speaks TLS only, so every service that got through above spoke TLS.
        with socket.create_connection(("127.0.0.1", cluster.nats_portals["nats"]), 5) as conn:
            run.result.notes["nats_plain_refused"] = _refuses_plain_nats(conn)
        result = await run.finish()
        result.port_collisions = sum(
            1 for i in (ids[holders.name], ids[spread.name])
            for c in _exit_codes(run, i) if c == COLLISION_EXIT)
        return result


def _refuses_anonymous(port: int) -> bool:
    """Whether the Redis server behind 127.0.0.1:`port` refuses a command sent without
    logging in (RESP by hand: a client library would try `default` and retry)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"*2\r\n$3\r\nGET\r\n$" + str(len(redis_keys.EPOCH)).encode()
                     + b"\r\n" + redis_keys.EPOCH.encode() + b"\r\n")
        return conn.recv(256).startswith(b"-NOAUTH")


def _nats_info(conn: socket.socket) -> tuple[dict[str, Any], Any]:
    """The INFO a NATS port sends first, and the connection as a file to go on with."""
    conn.settimeout(5)
    stream = conn.makefile("rwb")
    return json.loads(stream.readline().split(b" ", 1)[1]), stream


def _refuses_plain_nats(conn: socket.socket) -> bool:
    """Whether the NATS client port behind `conn` refuses a client speaking plain text: its
    INFO (sent once the server has waited servers.HANDSHAKE_FIRST_WAIT for a TLS handshake)
    says TLS is required, and a plain CONNECT is closed or answered -ERR."""
    info, stream = _nats_info(conn)
    stream.write(b'CONNECT {"verbose":false}\r\nPING\r\n')
    stream.flush()
    try:
        answer = stream.readline()
    except OSError:
        answer = b""
    return bool(info.get("tls_required")) and not answer.startswith(b"PONG")


def _routes_need_tls(bed: Bed, hosts: tuple[str, ...]) -> bool:
    """Whether every node's route port, dialled from another node's host, takes TLS only:
    a route port starts with the TLS handshake, so a peer that speaks plain text first gets
    no INFO and is closed (a plain route port sends INFO at once)."""
    for i, host in enumerate(hosts):
        with bed.connect(hosts[i - 1], bed.address(host), NATS_CLUSTER_PORT, 5) as conn:
            conn.settimeout(5)
            conn.sendall(b"PING\r\n")
            try:
                got = conn.recv(64)
            except OSError:
                got = b""
            if got.startswith(b"INFO"):
                return False
    return True


async def _submit(run: Run, spec: JobSpec) -> str:
    seq = await publish_submit(run.nc, encode(spec), subject=subjects.submit_job(None))
    outcome = await wait_for_outcome(run.nc, seq, timeout=30)
    if not outcome.accepted:
        raise RuntimeError(f"{spec.name} refused: {outcome.reason}")
    run.result.acked += 1
    run.jobs[str(outcome.job_id)] = spec.name
    return str(outcome.job_id)


# --- a worker whose link to NATS is slow ----------------------------------------------------


async def delayed_worker(bed: Bed, data_dir: Path, delay: float, hold: float) -> Result:
    slow = "w1"
    layout = Layout(dict(WORKERS3), api="svc", schedulers=("ctl", "ctl2"),
                    delayed={slow: delay})
    cluster = start_cluster(bed, data_dir, layout, ENV)
    async with Run(cluster, f"worker link delayed {delay * 1000:.0f} ms each way") as run:
        ids = await run.submit(9, cpu=0.5)
        await run.until("9 running", lambda: run.running(ids), 30)
        on_slow = sum(len(w["running_attempts"]) for w in run.workers()
                      if w["worker_id"] == slow)
        run.result.notes["tasks_on_slow_worker"] = on_slow
        await asyncio.sleep(hold)
        run.result.wrong_deaths = len(run.bus.deaths)
        return await run.finish()


# --- a host whose links lose packets -------------------------------------------------------


async def lossy_link(bed: Bed, data_dir: Path, host: str, peers: list[str], percent: int,
                     hold: float) -> Result:
    """`host` loses `percent` of its packets to and from `peers` (each packet on its own
    chance) for `hold` seconds, while tasks run and new jobs are placed: a worker's link to
    NATS, or the leader's to NATS and Redis. TCP retransmits, so heartbeats arrive late, not
    never: a verdict on a worker is justified only if the NATS server went longer than D
    without its heartbeat (each worker's longest gap is measured by a subscription of the
    test's, whose own link loses nothing), so with the leader's links lossy none is."""
    dead_after = float(ENV["BERTH_WORKER_DEAD_AFTER"])
    cluster = start_cluster(bed, data_dir, _layout_workers3(), ENV)
    async with Run(cluster, f"{host} losing {percent}% of packets to {'+'.join(peers)}, "
                            f"{hold:g} s") as run:
        ids = await run.submit(9, cpu=0.5)
        await run.until("9 running", lambda: run.running(ids), 30)
        notes = run.result.notes
        notes["tasks_on_lossy_host"] = sum(
            len(w["running_attempts"]) for w in run.workers() if w["worker_id"] == host)
        heard: dict[str, list[float]] = {w: [] for w in WORKERS3}

        async def heartbeat(msg: Any) -> None:
            heard.setdefault(msg.subject.rsplit(".", 1)[1], []).append(time.monotonic())

        sub = await run.nc.subscribe(subjects.HEARTBEATS_ALL, cb=heartbeat)
        elected = len(run.bus.elected)
        bed.lose([host], peers, percent)
        started = time.monotonic()
        later: list[str] = []
        while time.monotonic() < started + hold:
            later += await run.submit(1, cpu=0.1)
            await asyncio.sleep(1.5)
        bed.heal()
        ended = time.monotonic()
        await run.until("every later job running", lambda: run.running(later), 30)
        await asyncio.sleep(2)  # verdicts and fences that the loss set off land now
        await sub.unsubscribe()
        gaps = {w: max(b - a for a, b in itertools.pairwise(
            [started, *(t for t in times if started < t < ended), ended]))
            for w, times in heard.items()}
        notes["loss_percent"] = percent
        notes["longest_heartbeat_gap_s"] = round(max(gaps.values()), 1)
        notes["later_on_lossy_host"] = sum(
            1 for i in later for t in (run.job(i) or {"tasks": []})["tasks"]
            for a in t["attempts"] if a["worker_id"] == host)
        logs = [cluster.log(w) for w in WORKERS3]
        notes["fenced"] = sum(log.count("was fenced off") for log in logs)
        notes["new_incarnations"] = sum(log.count("starting a new incarnation") for log in logs)
        notes["take_overs"] = len(run.bus.elected) - elected
        notes["deaths"] = [w for _, w in run.bus.deaths]
        run.result.wrong_deaths = sum(1 for _, w in run.bus.deaths
                                      if gaps.get(w, 0.0) <= dead_after)
        return await run.finish()


# --- the table ------------------------------------------------------------------------------

BedScenario = Callable[[Bed, Path], Awaitable[Result]]

HOSTS = {
    "nats-minority": ["n1", "n2", "n3", "redis", "svc", "ctl", "ctl2", *WORKERS3],
    "redis-failover": ["nats", "r1", "r2", "r3", "s1", "s2", "s3", "svc", "ctl", "ctl2",
                       *WORKERS3],
    "redis-isolated": ["nats", "r1", "r2", "r3", "s1", "s2", "s3", "svc", "ctl", "ctl2",
                       *WORKERS3],
    "hosts": ["nats", "redis", "ctl", "g1", "g2", "g3", "g4"],
    "delayed-worker": ["nats", "redis", "svc", "ctl", "ctl2", *WORKERS3],
    "lossy-worker": ["nats", "redis", "svc", "ctl", "ctl2", *WORKERS3],
    "lossy-leader": ["nats", "redis", "svc", "ctl", "ctl2", *WORKERS3],
}


QUICK = ["hosts", "nats-minority"]
# The share of a lossy host's packets lost each way.
LOSS_PERCENT = 15


def scenarios(cut: float = 8, quick: bool = False) -> dict[str, BedScenario]:
    submits = 40 if quick else 400
    return {
        "nats-minority": lambda bed, d: nats_minority(bed, d, submits, min(cut, 4) if quick
                                                      else cut),
        "redis-failover": lambda bed, d: redis_failover(bed, d, cut),
        "redis-isolated": lambda bed, d: redis_failover(bed, d, cut, isolate=True),
        "hosts": lambda bed, d: hosts(bed, d, 4 if quick else 8),
        "delayed-worker": lambda bed, d: delayed_worker(bed, d, 0.2, 3 if quick else cut),
        "lossy-worker": lambda bed, d: lossy_link(bed, d, "w1", ["nats"], LOSS_PERCENT,
                                                  min(cut, 6) if quick else cut),
        # The leader starts on ctl (scheduler A), the standby on ctl2.
        "lossy-leader": lambda bed, d: lossy_link(bed, d, "ctl", ["nats", "redis"],
                                                  LOSS_PERCENT, min(cut, 6) if quick else cut),
    }


async def run_scenario(name: str, data_dir: Path, scenario: BedScenario | None = None
                       ) -> Result:
    """A fresh bed for one scenario, torn down whatever happens."""
    with Bed(HOSTS[name]) as bed:
        return await (scenario or scenarios()[name])(bed, data_dir)


def summary(result: Result) -> str:
    return json.dumps({"violations": result.violations(), **result.notes}, default=str)
