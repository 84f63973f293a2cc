"""Redis connections (one server, or the primary Sentinel names) and the Lua scripts (loaded
from `shared/lua/*.lua`, the dramatiq way)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from berth.shared.config import RedisSettings

# Every error a call can end in when Redis (or the primary) is away, or a failover has made
# the server a replica (READONLY): callers that must survive an outage catch these.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)

CONNECT_TIMEOUT = 1.0


class RedisConfigError(Exception):
    """A Redis URL that cannot be used; the message says why (never the password)."""


def _url_kwargs(url: str) -> dict[str, Any]:
    try:
        kwargs = dict(parse_url(url))
    except ValueError as exc:
        raise RedisConfigError(f"BERTH_REDIS_URL: {exc}") from None
    if "connection_class" in kwargs:
        raise RedisConfigError("BERTH_REDIS_URL: only redis:// URLs are supported")
    return kwargs


# How long the checker (`berth doctor`, the benchmarks') may wait for one reply: it reads
# every host in one MULTI, at 10,000 hosts 20,000 replies and 1-2 s of its own CPU, and on
# a busy server or a loaded machine a wait of the default 2.5 s ran out (docs/performance.md).
BULK_READ_TIMEOUT = 30.0


def open_client(settings: RedisSettings, read_timeout: float | None = None) -> aioredis.Redis:
    """A client for berth's Redis: the server in the URL, or, with sentinels, whichever
    server they name primary now (asked again after every lost connection, so a client
    follows a failover). No automatic retries: a caller sees an outage at once and decides
    (the scheduler stands down; a fenced write is never silently repeated).
    `read_timeout`: how long one reply may take (default: the WAIT timeout and 2 s)."""
    kwargs = _url_kwargs(settings.url)
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        # A WAIT blocks for up to its timeout: the socket must outlast it.
        "socket_timeout": read_timeout or settings.wait_timeout + 2.0,
        "retry": Retry(NoBackoff(), 0),
    }
    if not settings.sentinels:
        return aioredis.Redis(**kwargs, **common)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(settings.sentinels),
        # No credentials: a lookup needs none (redis_auth.SENTINEL_LOOKUP), and the
        # password is only ever sent to the server that Sentinel names.
        sentinel_kwargs={"socket_connect_timeout": CONNECT_TIMEOUT,
                         "socket_timeout": CONNECT_TIMEOUT, "decode_responses": True},
        **{k: v for k, v in kwargs.items() if k not in ("host", "port")},
        **common,
    )
    client: _SentinelClient = sentinel.master_for(settings.master, redis_class=_SentinelClient)
    client.sentinel_manager = sentinel
    return client


class _SentinelClient(aioredis.Redis):
    """The primary's client, which closes its connections to the Sentinels with its own."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            await self.sentinel_manager.aclose()


async def ask_again(client: aioredis.Redis) -> None:
    """Drops the client's connections, so that its next command connects afresh: with
    Sentinels, to whichever server they name primary *now*. A primary cut off from its
    replicas and Sentinels still answers its clients (refusing nothing, acknowledging no
    write): kept, the connection would go on asking it until the partition heals and Sentinel
    demotes it, however long after the replica was promoted."""
    await client.connection_pool.disconnect()


def connect(url: str) -> aioredis.Redis:
    """A client for one server at `url` (tests, tools)."""
    return open_client(RedisSettings(url=url))


def load_script(client: aioredis.Redis, name: str) -> AsyncScript:
    source = resources.files("berth.shared").joinpath("lua", f"{name}.lua").read_text()
    return client.register_script(source)


# One script call: the script, its keys, its arguments.
ScriptCall = tuple[AsyncScript, list[str], Sequence[str | int | bytes]]


async def run_scripts(client: aioredis.Redis, calls: Sequence[ScriptCall],
                      then: Sequence[tuple[str | int, ...]] = (), *,
                      wrote_nothing: Callable[[Any], bool]) -> list[Any]:
    """Runs `calls` in order, then the commands of `then`, in one pipeline: one round trip
    and one connection (a WAIT in `then` counts the scripts' writes). Returns their results
    in order; the first error among them is raised. Each call is an EVALSHA: a pipeline given
    redis-py's script objects asks SCRIPT EXISTS first, a round trip more every time.

    A script the server does not hold (restarted, or a replica just promoted) is loaded, and
    the calls it refused run again, in order, with `then` after them. So does every later
    call that ran before them but, as `wrote_nothing(result)` says, left no trace (refused,
    all or nothing): each call must see the writes of the calls before it."""
    results: list[Any] = [None] * len(calls)
    tail: list[Any] = []
    pending = list(range(len(calls)))
    for _ in range(2):
        async with client.pipeline(transaction=False) as pipe:
            for i in pending:
                script, keys, args = calls[i]
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            for command in then:
                pipe.execute_command(*command)
            out: list[Any] = await pipe.execute(raise_on_error=False)
        tail = out[len(pending):]
        for i, result in zip(pending, out, strict=False):
            results[i] = result
        refused = [i for i in pending if isinstance(results[i], NoScriptError)]
        if not refused:
            break
        for script in {id(calls[i][0]): calls[i][0] for i in refused}.values():
            script.sha = await client.script_load(script.script)
        pending = [i for i in pending if i in refused
                   or (i > refused[0] and wrote_nothing(results[i]))]
    for result in (*results, *tail):
        if isinstance(result, Exception):
            raise result
    return [*results, *tail]
