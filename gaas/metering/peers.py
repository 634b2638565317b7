"""The live routers, as each router counts them (Peers): every router writes its instance name in
one Redis sorted set, scored with when its entry lapses, every BEAT_SECONDS, drops the lapsed
entries and counts the rest. While Redis does not answer the last count stands (until Redis has
answered once, a router assumes it is alone): it is what each router's fallback admission divides
a tenant's quotas by (gaas.metering.local). A router that stops takes its entry out; one that
dies lapses after LAPSE_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.contracts import usage as metering

log = logging.getLogger(__name__)

ROUTERS_KEY = "gaas:routers"
BEAT_SECONDS = 5.0
LAPSE_SECONDS = 15.0


class Peers:
    """This router's entry among the live routers, and their count."""

    def __init__(self, redis: Redis, instance: str, clock: Callable[[], int] = metering.now_ms,
                 beat_seconds: float = BEAT_SECONDS, lapse_seconds: float = LAPSE_SECONDS) -> None:
        self._redis = redis
        self._instance = instance
        # Unix ms (tests move it); every router's clock is taken to be within seconds of the others'.
        self._clock = clock
        self._beat = beat_seconds
        self._lapse_ms = round(lapse_seconds * 1000)
        self._count = 1

    def routers(self) -> int:
        """The live routers, this one included, as last counted (1 until counted)."""
        return self._count

    async def beat(self) -> int:
        """Renew this router's entry and count the live ones (the last count when Redis does not answer)."""
        now = self._clock()
        pipe = self._redis.pipeline(transaction=True)
        pipe.zadd(ROUTERS_KEY, {self._instance: now + self._lapse_ms})
        pipe.zremrangebyscore(ROUTERS_KEY, "-inf", now)
        pipe.zcard(ROUTERS_KEY)
        try:
            *_, count = await pipe.execute()
        except RedisError as exc:
            log.debug("cannot count the live routers (%s); %d as last counted", exc, self._count)
            return self._count
        if count != self._count:
            log.info("%d routers share each tenant's quotas while Redis is away", count)
        self._count = max(1, count)
        return self._count

    async def run(self) -> None:
        """Beat every beat_seconds until cancelled."""
        while True:
            await self.beat()
            await asyncio.sleep(self._beat)

    async def leave(self) -> None:
        """Take this router's entry out (it stops)."""
        try:
            await self._redis.zrem(ROUTERS_KEY, self._instance)
        except RedisError:
            pass  # it lapses
