"""Redis connection and the Lua scripts (loaded from `shared/lua/*.lua`, the dramatiq way)."""

from __future__ import annotations

from importlib import resources

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=True)


def load_script(client: aioredis.Redis, name: str) -> AsyncScript:
    source = resources.files("shared").joinpath("lua", f"{name}.lua").read_text()
    return client.register_script(source)
