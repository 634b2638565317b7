"""Redis connections with deadlines on every call, a readable error when Redis is absent, and Lua
scripts called by their SHA."""

from __future__ import annotations

import hashlib

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError


class RedisUnavailable(RuntimeError):
    """Redis did not answer; the message names the URL and what to do."""


def connect(url: str, *, timeout: float | None = 2.0, connect_timeout: float = 2.0) -> aioredis.Redis:
    """timeout: for each call (None: none, for a subscription that waits as long as it must)."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout if timeout is None else timeout,
        health_check_interval=30,
        decode_responses=True,
    )


async def ping(client: aioredis.Redis, url: str) -> None:
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        raise RedisUnavailable(
            f"Redis at {url} does not answer ({exc}); start one (`make run` does) or set GAAS_REDIS_URL"
        ) from exc


class Script:
    """A Lua script called by its SHA (EVALSHA), sent whole once when Redis does not know it (a
    restarted Redis). Leaner than redis-py's Script on the request path."""

    def __init__(self, redis: aioredis.Redis, source: str) -> None:
        self._redis = redis
        self._source = source
        self._sha = hashlib.sha1(source.encode()).hexdigest()

    @property
    def sha(self) -> str:
        """Its SHA, for an EVALSHA in a pipeline (load() it when Redis does not know it)."""
        return self._sha

    async def load(self) -> None:
        await self._redis.script_load(self._source)

    async def __call__(self, keys: list[str], args: list) -> object:
        try:
            return await self._redis.execute_command("EVALSHA", self._sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self._redis.execute_command("EVAL", self._source, len(keys), *keys, *args)
