"""Real servers for the tests: one nats-server (JetStream) and one Redis-compatible server
per session, on free loopback ports (testcontainers instead when BERTH_TEST_DOCKER=1 and a
Docker engine answers). Each test that needs services gets them as real processes, and
starts from empty streams and an empty Redis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import redis as sync_redis
from nats.aio.client import Client as NATS

from berth.shared import nats_io, redis_auth, servers
from berth.stack import Stack, start_services


def _docker_servers(stack: Any) -> tuple[servers.ServerProcess, servers.ServerProcess] | None:
    if os.environ.get("BERTH_TEST_DOCKER") != "1":
        return None
    try:
        from testcontainers.core.container import DockerContainer  # type: ignore[import-not-found]
        from testcontainers.redis import RedisContainer  # type: ignore[import-not-found]
    except ImportError:
        pytest.skip("BERTH_TEST_DOCKER=1 needs `pip install testcontainers[redis]`")
    nats_c = DockerContainer("nats:2.10").with_command("-js").with_exposed_ports(4222)
    redis_c = RedisContainer("redis:7")
    stack.enter_context(nats_c)
    stack.enter_context(redis_c)
    n_port = int(nats_c.get_exposed_port(4222))
    r_port = int(redis_c.get_exposed_port(6379))

    class _External(servers.ServerProcess):
        def stop(self, timeout: float = 10) -> None:
            pass

    class _ExternalRedis(servers.RedisServer):
        # A container's Redis has no berth users: every user is the container's default.
        def stop(self, timeout: float = 10) -> None:
            pass

    return (_External("nats", f"nats://127.0.0.1:{n_port}", n_port, None),  # type: ignore[arg-type]
            _ExternalRedis("redis", f"redis://127.0.0.1:{r_port}/0", r_port, None))  # type: ignore[arg-type]


async def admin_connect(server: servers.ServerProcess) -> NATS:
    """A test's own connection to the bus, as the admin identity (which may do anything)."""
    return await nats_io.connect(server.url, "berth-test", server.admin_creds())


@pytest.fixture(scope="session")
def real_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[servers.ServerProcess, servers.RedisServer]]:
    with contextlib.ExitStack() as stack:
        docker = _docker_servers(stack)
        if docker:
            yield docker
            return
        data = tmp_path_factory.mktemp("servers")
        nats_server = servers.start_nats(data)
        redis_server = servers.start_redis(data)
        try:
            yield nats_server, redis_server
        finally:
            redis_server.stop()
            nats_server.stop()


@pytest.fixture
async def clean_servers(real_servers: tuple[servers.ServerProcess, servers.RedisServer]
                        ) -> tuple[servers.ServerProcess, servers.RedisServer]:
    """The session's servers with every berth stream deleted and Redis flushed."""
    nats_server, redis_server = real_servers
    nc = await admin_connect(nats_server)
    js = nc.jetstream()
    for config in nats_io.STREAMS:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_stream(config.name)
    # nats-server may still be removing a just-deleted stream's files ("error creating
    # store for stream"): give it a moment rather than fail the next test's setup.
    for attempt in range(10):
        try:
            await nats_io.ensure_streams(js)
            break
        except nats.js.errors.ServerError:
            if attempt == 9:
                raise
            await asyncio.sleep(0.3)
    await nc.close()
    # Only the admin user may flush: the services' users are confined to berth's keys.
    sync_redis.Redis.from_url(redis_server.url_for(redis_auth.ADMIN)).flushall()
    return real_servers


@pytest.fixture
async def nc(clean_servers: tuple[servers.ServerProcess, servers.RedisServer]
             ) -> AsyncIterator[NATS]:
    client = await admin_connect(clean_servers[0])
    yield client
    await client.close()


@pytest.fixture
def make_stack(clean_servers: tuple[servers.ServerProcess, servers.RedisServer],
               tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """Starts the four services and N workers as real processes; stops them after the test.
    `redis`: another Redis than the session's (e.g. a replicated one the test started)."""
    started: list[Stack] = []

    def make(workers: int = 2, redis: servers.RedisServer | servers.ReplicatedRedis | None = None,
             **kwargs: Any) -> Stack:
        env = {"BERTH_HEARTBEAT_INTERVAL": "0.5", "BERTH_WORKER_DEAD_AFTER": "3",
               "BERTH_KILL_GRACE": "2", **kwargs.pop("extra_env", {})}
        stack = start_services(tmp_path / "berth", clean_servers[0], redis or clean_servers[1],
                               workers=workers, extra_env=env, **kwargs)
        started.append(stack)
        return stack

    yield make
    crashed = []
    for stack in started:
        for label, proc in stack.children.items():
            if proc.poll() not in (None, 0):  # a service must never die during a test
                log = (stack.data_dir / "logs" / f"{label}.log").read_text()[-2000:]
                crashed.append(f"{label} exited with {proc.returncode}:\n{log}")
        stack.stop()
    assert not crashed, "\n".join(crashed)


async def wait_until(predicate: Callable[[], Any], timeout: float = 30,
                     what: str = "condition") -> Any:
    """Polls `predicate` (without blocking the event loop between polls) until truthy."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def get_json(stack: Stack, path: str) -> Any:
    resp = httpx.get(stack.api_url + path, timeout=10)
    resp.raise_for_status()
    return resp.json()


async def wait_for_job(stack: Stack, job_id: str, states: set[str], timeout: float = 30
                       ) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        resp = httpx.get(f"{stack.api_url}/api/jobs/{job_id}", timeout=10)
        if resp.status_code == 404:
            return None
        job: dict[str, Any] = resp.json()
        return job if job["state"] in states else None

    result: dict[str, Any] = await wait_until(check, timeout, f"job {job_id} to reach {states}")
    return result


async def run_doctor(stack: Stack) -> str:
    """`berth doctor` beside the stack, as a user runs it (the read-only Redis user): its
    output, once it has exited 0."""
    from berth.shared import redis_auth

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "berth.cli", "--data-dir", str(stack.data_dir), "doctor",
        "--redis-url", stack.redis.url_for(redis_auth.DOCTOR),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()
