"""Redis connections with deadlines on every call, a readable error when Redis is absent, and Lua
scripts called by their SHA."""

from __future__ import annotations

import hashlib

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError


class RedisUnavailable(RuntimeError):
    """Redis did not answer; the message names the URL and what to do."""


def connect(url: str, *, timeout: float | None = 2.0, connect_timeout: float = 2.0,
            retries: int | None = None) -> aioredis.Redis:
    """timeout: for each call (None: none, for a subscription that waits as long as it must).
    retries: how often a call that failed on its connection is tried again, at once, on a new one
    (a connection a restarted Redis closed); None: redis-py's default (10 times, backing off up to
    1 s each: seconds before a call fails while Redis is away), for callers with no fallback."""
    extra = {} if retries is None else {"retry": Retry(NoBackoff(), retries)}
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout if timeout is None else timeout,
        health_check_interval=30,
        decode_responses=True,
        **extra,
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
