"""Redis connections with deadlines on every call, and a readable error when Redis is absent."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import RedisError


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
