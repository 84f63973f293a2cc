"""berth across the test bed: each server and service in a host of its own (or sharing one),
every connection made over the bridge to the namespace addresses, with the credentials files
an operator would hand each service (BERTH_NATS_CREDS from the auth folder).

The default layout (hosts may be merged or spread by passing another):

    nats   nats-server (JetStream)          redis  valkey
    ctl    scheduler A (leader), and the submitter and dashboard unless `api_host` says
    ctl2   scheduler B (standby)            w1..wN one worker each, --address its own

The test reaches NATS, Redis and the dashboard through portals (tests/netbed.py), whose
connections start inside the server's own host, so no partition cuts the test's view.
A NATS cluster or Sentinel can later be placed the same way: one server per host, the
services given the namespace addresses.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from nats.aio.client import Client as NATS

from shared import nats_io, servers
from shared.credentials import AuthDir, Role, identity_name
from shared.reservations import ReservationStore
from tests.netbed import Bed, BedError

NATS_PORT = 4222
REDIS_PORT = 6379
API_PORT = 8080
# The dashboard listens beyond loopback here, so its reads are closed: the test reads as
# the admin (BERTH_API_TOKEN).
API_TOKEN = "bed-admin-token"
HEADERS = {"Authorization": f"Bearer {API_TOKEN}"}
MODULES = {"scheduler": "services.scheduler", "submitter": "services.submitter",
           "dashboard": "services.dashboard_api", "worker": "services.worker_agent"}
ROLES = {"scheduler": Role.SCHEDULER, "submitter": Role.SUBMITTER,
         "dashboard": Role.DASHBOARD, "worker": Role.WORKER}


def hosts_for(workers: int) -> list[str]:
    return ["nats", "redis", "ctl", "ctl2", *(f"w{i}" for i in range(1, workers + 1))]


@dataclass
class BedCluster:
    bed: Bed
    data_dir: Path
    env: dict[str, str]
    nats_host: str = "nats"
    redis_host: str = "redis"
    api_host: str = "ctl"
    # label -> (host, process); `stopped` are those the test stopped on purpose.
    services: dict[str, tuple[str, subprocess.Popen[bytes]]] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)
    nats_port_local: int = 0
    redis_port_local: int = 0
    api_port_local: int = 0

    @property
    def auth(self) -> AuthDir:
        return AuthDir.of(self.data_dir)

    @property
    def nats_url(self) -> str:
        """The test's way in (a portal)."""
        return f"nats://127.0.0.1:{self.nats_port_local}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port_local}/0"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port_local}"

    def start_service(self, kind: str, host: str, *args: str, label: str | None = None,
                      scope: str = "") -> subprocess.Popen[bytes]:
        label = label or kind
        creds = self.auth.creds_path(identity_name(ROLES[kind], scope))
        if not creds.exists():
            raise BedError(f"no identity for {kind} {scope!r}: make it before NATS starts")
        env = {**self.env, "BERTH_NATS_CREDS": str(creds)}
        proc = self.bed.spawn(host, [sys.executable, "-m", MODULES[kind], *args],
                              self.data_dir / "logs" / f"{label}.log", env)
        self.services[label] = (host, proc)
        return proc

    def start_worker(self, worker_id: str, host: str, cpu: float = 2,
                     memory_mb: int = 2048) -> subprocess.Popen[bytes]:
        return self.start_service("worker", host, "--id", worker_id, "--cpu", str(cpu),
                                  "--memory-mb", str(memory_mb),
                                  "--address", self.bed.address(host),
                                  label=worker_id, scope=worker_id)

    def died(self) -> list[str]:
        """Services that exited without being asked to."""
        return [f"{label} (exit {proc.returncode})"
                for label, (_, proc) in self.services.items()
                if label not in self.stopped and proc.poll() is not None]

    def log(self, label: str) -> str:
        path = self.data_dir / "logs" / f"{label}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    async def admin(self) -> NATS:
        return await nats_io.connect(self.nats_url, "berth-bed-test",
                                     self.auth.ensure(Role.ADMIN))

    def store(self) -> ReservationStore:
        from shared import redis_io
        return ReservationStore(redis_io.connect(self.redis_url))

    def get(self, path: str) -> object:
        resp = httpx.get(self.api_url + path, timeout=10, headers=HEADERS)
        resp.raise_for_status()
        return resp.json()


def start_cluster(bed: Bed, data_dir: Path, workers: Sequence[str],
                  extra_env: dict[str, str] | None = None, standby: bool = True,
                  api_host: str = "ctl") -> BedCluster:
    """Servers, a leader (then a standby), the submitter, the dashboard and one worker per
    name in `workers` (each on the host of that name). The caller's `bed.stop()` stops it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    auth = AuthDir.of(data_dir)
    servers.ensure_service_identities(auth)
    auth.ensure(Role.ADMIN)
    for worker_id in workers:
        auth.ensure(Role.WORKER, worker_id)
    users = servers.write_nats_users(auth)

    # nats-server, listening on its host's address only.
    store = data_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    config = store / "server.conf"
    config.write_text(servers.nats_config(NATS_PORT, store, users, store,
                                          host=bed.address("nats")))
    nats = bed.spawn("nats", [servers.nats_server_binary(), "-c", str(config)],
                     data_dir / "logs" / "nats-server.log")
    redis_store = data_dir / "redis"
    redis_store.mkdir(parents=True, exist_ok=True)
    redis = bed.spawn("redis", [
        servers.redis_server_binary(), "--port", str(REDIS_PORT),
        "--bind", bed.address("redis"), "--dir", str(redis_store), "--appendonly", "yes",
        "--save", "", "--protected-mode", "no"], data_dir / "logs" / "redis-server.log")
    bed.wait_for_port("nats", NATS_PORT, nats, "nats-server")
    bed.wait_for_port("redis", REDIS_PORT, redis, "valkey")

    env = servers.service_env(
        f"nats://{bed.address('nats')}:{NATS_PORT}",
        f"redis://{bed.address('redis')}:{REDIS_PORT}/0", data_dir,
        BERTH_API_HOST=bed.address(api_host), BERTH_API_PORT=str(API_PORT),
        BERTH_API_TOKEN=API_TOKEN, **(extra_env or {}))
    env.pop("BERTH_NATS_CREDS", None)
    cluster = BedCluster(bed, data_dir, env, api_host=api_host)
    cluster.services["nats-server"] = ("nats", nats)
    cluster.services["valkey"] = ("redis", redis)
    cluster.nats_port_local = bed.portal("nats", NATS_PORT)
    cluster.redis_port_local = bed.portal("redis", REDIS_PORT)
    cluster.api_port_local = bed.portal(api_host, API_PORT)

    cluster.start_service("scheduler", "ctl", label="scheduler-a")
    wait_for(lambda: "leading with epoch" in cluster.log("scheduler-a"), 30,
             "scheduler A to lead", cluster)
    cluster.start_service("submitter", api_host)
    cluster.start_service("dashboard", api_host)
    for worker_id in workers:
        cluster.start_worker(worker_id, worker_id)
    if standby:
        cluster.start_service("scheduler", "ctl2", label="scheduler-b")
    wait_for(lambda: _api_ok(cluster), 30, "the dashboard", cluster)
    wait_for(lambda: len(_workers(cluster)) == len(workers), 30, "the workers", cluster)
    return cluster


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

