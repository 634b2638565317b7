"""The registry's changes as control announces them (a worker registered, left or began to drain:
gaas.contracts.services.REGISTRY_CHANGED_CHANNEL): the router reads its view of the mesh again at
once, not at its next refresh. The Envoys' membership follows the registry as fast (xDS, pushed by
control), so a router whose view lagged would name a worker the ingress no longer has (the
ingress answers such a request 503 no_healthy_upstream)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from gaas.runtime import redisconn
from gaas.contracts.services import REGISTRY_CHANGED_CHANNEL as CHANGED_CHANNEL

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0


async def follow(redis_url: str, changed: Callable[[], Awaitable[object]]) -> None:
    """Call changed() at each announced change, until cancelled (reconnecting when Redis goes away;
    meanwhile the router's periodic refresh is all)."""
    failing = False
    while True:
        client = redisconn.connect(redis_url, timeout=None)
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(CHANGED_CHANNEL)
                if failing:
                    log.info("hearing the registry's changes again")
                    failing = False
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        try:
                            await changed()
                        except Exception as exc:  # noqa: BLE001 - the periodic refresh catches up
                            log.debug("refresh after a registry change failed: %s", exc)
        except (RedisError, OSError) as exc:
            if not failing:
                log.warning("cannot hear the registry's changes (%s); the periodic refresh alone keeps the view", exc)
            failing = True
        finally:
            await client.aclose()
        await asyncio.sleep(RETRY_SECONDS)
