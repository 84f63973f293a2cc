"""The embedded stack: NATS, a Redis-compatible server, the four services and local workers,
each a child process; stopping the stack stops every one of them. While it runs, `berth up`
calls `Stack.supervise`, which starts again (with backoff, berth/restarts.py) any child
that exited."""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from berth.creds_cli import local_user
from berth.restarts import ChildHistory, RestartPolicy, after_exit, restarted
from berth.shared import config, dir_lock, redis_auth, servers
from berth.shared.credentials import AuthDir, Role, identity_name
from berth.stack_info import STACK_INFO

SERVICE_MODULES = {
    "submitter": "berth.services.submitter",
    "scheduler": "berth.services.scheduler",
    "dashboard": "berth.services.dashboard_api",
    "worker": "berth.services.worker_agent",
}


def service_command(name: str, *args: str) -> list[str]:
    """The command line that starts one service as a process. `-P`: `python -m` would put
    the working directory first on sys.path, so a `berth/` folder where the user stands
    would be imported instead of berth's own (issue 17 item 6)."""
    return [sys.executable, "-P", "-m", SERVICE_MODULES[name], *args]


SERVICE_ROLES = {"submitter": Role.SUBMITTER, "scheduler": Role.SCHEDULER,
                 "dashboard": Role.DASHBOARD, "worker": Role.WORKER}


API_TOKEN_FILE = "api-token"
STACK_LOCK = "stack.lock"


@dataclass(frozen=True)
class Launch:
    """How a child was started, to start it again the same way."""
    name: str
    args: tuple[str, ...]
    env: dict[str, str] | None
    scope: str


@dataclass
class Supervised:
    """A child (or server) under `berth up`'s watch."""
    history: ChildHistory
    launch: Launch | None = None
    # Set while it is down: when it is to be started again (time.monotonic()).
    restart_at: float | None = None
    last_exit: int | None = None


@dataclass
class Stack:
    data_dir: Path
    nats: servers.NatsServers
    redis: servers.RedisServer | servers.ReplicatedRedis
    api_port: int
    env: dict[str, str]
    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    owns_servers: bool = True
    # `berth up`'s lock on the data dir (start_stack); its children inherit it.
    lock: dir_lock.DirLock | None = None
    supervised: dict[str, Supervised] = field(default_factory=dict)
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    rng: random.Random = field(default_factory=random.Random)
    prefer_redis_on_path: bool = False
    # Each service's metrics endpoint by label, when started with metrics ports (the
    # dashboard's is also on its API port, at /metrics).
    metrics_urls: dict[str, str] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def api_token(self) -> str:
        return self.env["BERTH_API_TOKEN"]

    @property
    def auth(self) -> AuthDir:
        assert self.nats.auth_dir is not None, "berth's NATS always runs with identities"
        return AuthDir(self.nats.auth_dir)

    def creds_for(self, role: Role, scope: str = "") -> Path:
        """The credentials file of one identity, made (and the NATS server told of it, by
        a config reload) the first time it is asked for."""
        path = self.auth.creds_path(identity_name(role, scope))
        if not path.exists():
            creds = self.auth.ensure(role, scope)
            servers.write_nats_users(self.auth)
            # Every node includes the same users file: each is reloaded, and each must
            # admit the new identity before it is used (a client may land on any of them).
            servers.reload_all(self.nats, creds)
        return path

    def start_service(self, name: str, *args: str, label: str | None = None,
                      env: dict[str, str] | None = None, scope: str = ""
                      ) -> subprocess.Popen[bytes]:
        label = label or name
        launch = Launch(name, args, env, scope)
        proc = self._spawn(label, launch)
        self.supervised[label] = Supervised(ChildHistory(time.monotonic()), launch)
        return proc

    def _spawn(self, label: str, launch: Launch) -> subprocess.Popen[bytes]:
        name, args, env, scope = launch.name, launch.args, launch.env, launch.scope
        log_path = self.data_dir / "logs" / f"{label}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Simulated hosts share one connection for many worker ids: only an admin may.
        role = Role.ADMIN if "--simulate" in args else SERVICE_ROLES[name]
        creds = {"BERTH_NATS_CREDS": str(self.creds_for(role, scope))}
        if name == "scheduler":
            # Only the scheduler writes Redis, so only it gets a Redis password.
            creds.update(self.redis.client_env(redis_auth.SCHEDULER))
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                service_command(name, *args),
                env={**self.env, **creds, **(env or {})}, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                pass_fds=dir_lock.inherited_fds(),
            )
        self.children[label] = proc
        return proc

    def start_worker(self, worker_id: str, cpu: float = 2, memory_mb: int = 2048,
                     *extra: str, env: dict[str, str] | None = None
                     ) -> subprocess.Popen[bytes]:
        """A local worker; `extra` are more `berth run worker` flags (devices, attributes)."""
        return self.start_service("worker", "--id", worker_id, "--cpu", str(cpu),
                                  "--memory-mb", str(memory_mb), "--address", "127.0.0.1",
                                  *extra, label=worker_id, scope=worker_id, env=env)

    def stop_child(self, label: str, timeout: float = 15) -> None:
        proc = self.children.pop(label)
        self.supervised.pop(label, None)
        servers.stop_process(proc, timeout)

    def supervise(self) -> list[str]:
        """One look at every child and server: one that exited is given a restart time
        (backoff, berth/restarts.py), one whose time has come is started again. Returns
        what happened, a line each. Raises servers.ServerError when a server that exited
        cannot be started again: the stack cannot run without it."""
        now = time.monotonic()
        said: list[str] = []
        for label, proc in list(self.children.items()):
            sup = self.supervised.get(label)
            if sup is None or sup.launch is None:
                continue  # not started by start_service: nothing to start it again with
            if sup.restart_at is None:
                if proc.poll() is not None:
                    said.append(self._exited(label, sup, proc, now))
            elif now >= sup.restart_at:
                try:
                    new = self._spawn(label, sup.launch)
                except OSError as exc:
                    said.append(f"{label} could not be started ({exc}); "
                                + self._exited(label, sup, proc, now))
                    continue
                sup.history, sup.restart_at = restarted(sup.history, now), None
                said.append(f"restarted {label} (pid {new.pid}, restart "
                            f"{sup.history.restarts})")
        if self.owns_servers:
            said += self._supervise_servers(now)
        if said:
            self.write_info()
        return said

    def _exited(self, label: str, sup: Supervised, proc: subprocess.Popen[bytes],
                now: float) -> str:
        sup.history, delay = after_exit(self.restart_policy, sup.history, now,
                                        self.rng.random())
        sup.restart_at, sup.last_exit = now + delay, proc.returncode
        return (f"{label} (pid {proc.pid}) exited with code {proc.returncode}; restarting "
                f"in {delay:.1f}s (see {self.data_dir / 'logs' / (label + '.log')})")

    def _supervise_servers(self, now: float) -> list[str]:
        """Servers are started again on their own port, config and store; while one is
        down, the services retry their connections. A ReplicatedRedis is left to its
        Sentinels."""
        said: list[str] = []
        for label, server in self._servers():
            sup = self.supervised.setdefault(label, Supervised(ChildHistory(now)))
            if sup.restart_at is None:
                if server.proc.poll() is not None:
                    said.append(self._exited(label, sup, server.proc, now))
            elif now >= sup.restart_at:
                # A server that cannot start again ends the stack: `berth up` stops.
                try:
                    self._restart_server(server)
                except OSError as exc:
                    raise servers.ServerError(
                        f"{label} could not be started again: {exc}") from exc
                sup.history, sup.restart_at = restarted(sup.history, now), None
                said.append(f"restarted {label} (pid {server.proc.pid}, restart "
                            f"{sup.history.restarts})")
        return said

    def _restart_server(self, server: servers.ServerProcess) -> None:
        if isinstance(self.nats, servers.NatsCluster) and server in self.nats.nodes:
            self.nats.restart(self.nats.nodes.index(server))
        elif server is self.redis:
            assert isinstance(self.redis, servers.RedisServer)
            server.proc = servers.start_redis(self.data_dir, server.port,
                                              self.prefer_redis_on_path).proc
        else:
            server.proc = servers.start_nats(self.data_dir, server.port).proc

    def _servers(self) -> list[tuple[str, servers.ServerProcess]]:
        """The servers `berth up` watches, by label; not a ReplicatedRedis (its Sentinels
        fail over)."""
        many = len(self.nats.nodes) > 1
        watched = [(f"{node.name}-{i}" if many else node.name, node)
                   for i, node in enumerate(self.nats.nodes)]
        if isinstance(self.redis, servers.RedisServer):
            watched.append((self.redis.name, self.redis))
        return watched

    def process_table(self) -> dict[str, dict[str, int | None]]:
        """Per child and server: its pid, how often it was restarted, its last exit code."""
        pids = {label: proc.pid for label, proc in self.children.items()}
        if self.owns_servers:
            pids |= {label: server.proc.pid for label, server in self._servers()}
        shown: dict[str, dict[str, int | None]] = {}
        for label, pid in pids.items():
            sup = self.supervised.get(label)
            shown[label] = {"pid": pid, "restarts": sup.history.restarts if sup else 0,
                            "last_exit": sup.last_exit if sup else None}
        return shown

    def stop(self) -> None:
        # Workers first (they stop their tasks), then the services, then the servers.
        order = sorted(self.children, key=lambda k: k in SERVICE_MODULES)
        for label in order:
            if self.children[label].poll() is None:
                self.children[label].send_signal(signal.SIGTERM)
        for label in order:
            servers.stop_process(self.children.pop(label), 15)
        if self.owns_servers:
            self.redis.stop()
            self.nats.stop()
        (self.data_dir / STACK_INFO).unlink(missing_ok=True)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def write_info(self) -> None:
        pids = [node.proc.pid for node in self.nats.nodes]
        # No passwords here: `berth doctor` takes its own from <data dir>/auth/redis.json.
        info = {"nats_url": self.nats.url, "redis_url": self.redis.url, "api_url": self.api_url,
                "pid": os.getpid(), "nats_pid": pids[0], "nats_pids": pids,
                "auth_dir": str(self.auth.path), "children": self.process_table()}
        if self.metrics_urls:
            info["metrics_urls"] = self.metrics_urls
        if isinstance(self.redis, servers.ReplicatedRedis):
            info |= {"redis_sentinels": self.redis.sentinel_addresses,
                     "redis_master": self.redis.master}
        # Replaced whole, never seen half written by a `berth` command reading it.
        tmp = self.data_dir / (STACK_INFO + ".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(self.data_dir / STACK_INFO)


def start_servers(data_dir: Path, nats_port: int | None = None, redis_port: int | None = None,
                  prefer_redis_on_path: bool = False, nats_nodes: int = 1
                  ) -> tuple[servers.NatsServers, servers.RedisServer]:
    """NATS (one server, or a cluster of `nats_nodes` whose first node listens on
    `nats_port`) and the Redis-compatible server."""
    nats: servers.NatsServers
    if nats_nodes > 1:
        ports = None
        if nats_port:
            others = [p for p in servers.free_ports(nats_nodes) if p != nats_port]
            ports = [nats_port, *others[:nats_nodes - 1]]
        nats = servers.start_nats_cluster(data_dir, nats_nodes, ports=ports)
    else:
        nats = servers.start_nats(data_dir, nats_port)
    try:
        redis = servers.start_redis(data_dir, redis_port, prefer_redis_on_path)
    except BaseException:  # a SystemExit too (a benchmark's SIGTERM): nothing else stops it
        nats.stop()
        raise
    return nats, redis


def start_stack(
    data_dir: Path,
    workers: int = 2,
    worker_cpu: float = 2,
    worker_memory_mb: int = 2048,
    api_port: int | None = None,
    nats_port: int | None = None,
    redis_port: int | None = None,
    prefer_redis_on_path: bool = False,
    extra_env: dict[str, str] | None = None,
    nats_nodes: int = 1,
    metrics: bool = False,
) -> Stack:
    """Everything of `berth up`, on a data dir no other stack uses: raises
    dir_lock.DirLocked (naming the holder) before anything starts if one does. `metrics`:
    as start_services."""
    lock = dir_lock.acquire(data_dir / STACK_LOCK, "berth up", inherit=True)
    try:
        nats, redis = start_servers(data_dir, nats_port, redis_port, prefer_redis_on_path,
                                    nats_nodes)
    except BaseException:
        lock.release()
        raise
    stack = start_services(data_dir, nats, redis, workers, worker_cpu, worker_memory_mb,
                           api_port, extra_env, owns_servers=True, lock=lock, metrics=metrics)
    stack.prefer_redis_on_path = prefer_redis_on_path
    return stack


def start_services(
    data_dir: Path,
    nats: servers.NatsServers,
    redis: servers.RedisServer | servers.ReplicatedRedis,
    workers: int = 2,
    worker_cpu: float = 2,
    worker_memory_mb: int = 2048,
    api_port: int | None = None,
    extra_env: dict[str, str] | None = None,
    owns_servers: bool = False,
    lock: dir_lock.DirLock | None = None,
    metrics: bool = False,
) -> Stack:
    """The four services and `workers` local workers against servers already running. On a
    NATS cluster the streams get its replica count (3 from 3 nodes on) unless `extra_env`
    says otherwise. `metrics`: each service serves Prometheus metrics on a free port of
    its own (BERTH_METRICS_PORT), listed in `Stack.metrics_urls`; so does a stack whose
    environment sets BERTH_METRICS_PORT, on that port and the ones after it."""
    api_port = api_port or servers.free_port()
    env = servers.service_env(nats.url, redis.url, data_dir, **{
        "BERTH_API_PORT": str(api_port), "BERTH_STREAM_REPLICAS": str(nats.stream_replicas),
        **(extra_env or {})})
    env["BERTH_API_TOKEN"] = env.get("BERTH_API_TOKEN") or api_token(data_dir)
    stack = Stack(data_dir, nats, redis, api_port, env, owns_servers=owns_servers, lock=lock)
    try:
        # The `berth` command run here speaks as the local user (creds_cli.cli_credentials).
        if user := local_user():
            stack.creds_for(Role.SUBMIT, user)
        labels = ["submitter", "scheduler", "dashboard", *(f"local-{i}" for i in range(workers))]
        # BERTH_METRICS_PORT given to the whole stack is where its range starts: handed to
        # every child as it is, all but one would fail to bind it.
        base = config.metrics_port(env)
        ports = (dict(zip(labels, servers.free_ports(len(labels)), strict=True)) if metrics
                 else {label: base + i for i, label in enumerate(labels)} if base else {})

        def metrics_env(label: str) -> dict[str, str]:
            if label not in ports:
                return {}
            stack.metrics_urls[label] = f"http://127.0.0.1:{ports[label]}/metrics"
            return {"BERTH_METRICS_PORT": str(ports[label])}

        for name in ("submitter", "scheduler", "dashboard"):
            stack.start_service(name, env=metrics_env(name) or None)
        for i in range(workers):
            # Each worker offers every GPU it discovers: on a GPU host only the first may,
            # or two workers would give one GPU to two tasks (docs/gpus.md).
            stack.start_worker(f"local-{i}", worker_cpu, worker_memory_mb,
                               env={**({} if i == 0 else {"CUDA_VISIBLE_DEVICES": ""}),
                                    **metrics_env(f"local-{i}")} or None)
        wait_for_api(stack)
    except BaseException:
        stack.stop()
        raise
    stack.write_info()
    return stack


def api_token(data_dir: Path) -> str:
    """The local cluster's API token: made once, kept (owner-only) in the data dir so a
    restarted `berth up` keeps it."""
    path = data_dir / API_TOKEN_FILE
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return token


def wait_for_api(stack: Stack, timeout: float = 30) -> None:
    """Until the dashboard answers /healthz with 200: it has caught up with the log."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    folded: object = None
    while time.monotonic() < deadline:
        for label, proc in stack.children.items():
            if proc.poll() is not None:
                raise servers.ServerError(
                    f"{label} exited with code {proc.returncode}; see "
                    f"{stack.data_dir / 'logs' / (label + '.log')}"
                )
        try:
            with urllib.request.urlopen(stack.api_url + "/healthz", timeout=1):
                return
        except urllib.error.HTTPError as exc:
            # 503: it answers, still folding the log. Callers get a caught-up dashboard,
            # and a long log is waited for as long as the fold makes progress.
            if exc.code == 503:
                try:
                    seq = json.loads(exc.read()).get("events_seq")
                except (ValueError, AttributeError):
                    seq = None
                if seq != folded:
                    folded, deadline = seq, time.monotonic() + timeout
            time.sleep(0.1)
        except OSError:
            time.sleep(0.1)
    raise servers.ServerError(f"the dashboard API did not answer on {stack.api_url}")
