"""A worker's warm-up: once its engine is loaded and before it registers (so before any router
sends it a request), a few short requests run through the engine, so that the first tenant's
request does not pay for the engine's first steps (allocations, the first batch's shapes). Their
blocks are cached under a salt no tenant has, and the prefix cache is emptied after them."""

from __future__ import annotations

import asyncio
import logging
import time

from services.worker.engine import GenerationRequest

log = logging.getLogger(__name__)

# The salt warm-up requests are cached under (no tenant's: a tenant's salt is derived from its key).
SALT = "gaas-warmup"
PROMPT = "The mesh warms up before it serves: rivers run down to the sea. "


async def warm_up(engine, requests: int, max_tokens: int = 8) -> float:
    """Runs requests short generations at once (prompts of growing length); returns the seconds taken."""
    if requests <= 0:
        return 0.0
    start = time.perf_counter()

    async def one(i: int) -> None:
        r = GenerationRequest(request_id=f"warmup-{i}-{time.monotonic_ns()}", prompt=PROMPT * (1 + 4 * i),
                              prompt_token_ids=[], max_tokens=max_tokens, sampling={"temperature": 0.0},
                              cache_salt=SALT)
        async for _ in engine.generate(r):
            pass

    await asyncio.gather(*(one(i) for i in range(requests)))
    await engine.reset_prefix_cache()
    took = time.perf_counter() - start
    log.info("warmed up: %d requests in %.0f ms", requests, took * 1000)
    return took
