"""A worker's warm-up: once its engine is loaded and before it registers (so before any router
sends it a request), a few short requests run through the engine, so that the first tenant's
request does not pay for the engine's first steps (allocations, the first batch's shapes). Their
blocks are cached under a salt no tenant has, and the prefix cache is emptied after them. Then the
model's public prefixes (`gaas kv public add`) are primed: each is computed once, as a chat's system
prompt and as a completion prompt's beginning, under the public salt every tenant's request that
begins with it is cached under, so the first such request hits (the KV directories learn the blocks
from the snapshot they take when they watch the worker)."""

from __future__ import annotations

import asyncio
import logging
import time

from collections.abc import Sequence

from gaas.contracts.kvhash import public_salt
from gaas.contracts.tasks import EMBED
from services.worker.engine import EmbeddingRequest, GenerationRequest

log = logging.getLogger(__name__)

# The salt warm-up requests are cached under (no tenant's: a tenant's salt is derived from its key).
SALT = "gaas-warmup"
PROMPT = "The mesh warms up before it serves: rivers run down to the sea. "


async def warm_up(engine, requests: int, max_tokens: int = 8) -> float:
    """Runs requests short generations (a model that pools: embeddings) at once, prompts of growing
    length; returns the seconds taken."""
    if requests <= 0:
        return 0.0
    start = time.perf_counter()

    async def one(i: int) -> None:
        if engine.info.task == EMBED:
            await engine.embed(EmbeddingRequest(f"warmup-{i}-{time.monotonic_ns()}", [PROMPT * (1 + 4 * i)],
                                                cache_salt=SALT))
            return
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


async def prime(engine, prefixes: Sequence[tuple[str, str]]) -> int:
    """Compute each public prefix (id, text) once, in its chat and its text form, under its public
    salt; returns how many were primed (one that fails is logged and skipped)."""
    if engine.info.task == EMBED:  # (a prefix's blocks serve generations; a pooling model has none)
        return 0
    start, primed = time.perf_counter(), 0
    for prefix_id, text in prefixes:
        salt = public_salt(prefix_id)
        forms = (GenerationRequest(request_id=f"prime-{prefix_id}-chat-{time.monotonic_ns()}", prompt="",
                                   prompt_token_ids=[], max_tokens=1, messages=[("system", text)],
                                   add_special_tokens=False, add_generation_prompt=False, cache_salt=salt),
                 GenerationRequest(request_id=f"prime-{prefix_id}-text-{time.monotonic_ns()}", prompt=text,
                                   prompt_token_ids=[], max_tokens=1, cache_salt=salt))
        try:
            for r in forms:
                async for _ in engine.generate(r):
                    pass
            primed += 1
        except Exception as exc:  # noqa: BLE001 - its first request computes it instead
            log.warning("cannot prime public prefix %s: %s: %s", prefix_id, type(exc).__name__, exc)
    if prefixes:
        log.info("primed %d public prefix(es) in %.0f ms", primed, (time.perf_counter() - start) * 1000)
    return primed
