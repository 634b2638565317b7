"""Dimension 4, memory fragmentation (the KV directory's, the engines'), under a churn workload:
many concurrent requests of random prompt and answer lengths, unique prompts, against workers
whose KV caches they overfill, so blocks are allocated, evicted and reused all the time.

How the figures relate to the seed's definition. Seed 003 measures fragmentation as the failure
rate of contiguous device-memory allocations and the cost of re-allocating. vLLM's paged KV cache
never allocates contiguously: every sequence takes fixed-size blocks from one pool, so external
fragmentation cannot occur by construction. What is left, each measured here:
  - internal fragmentation: the unused slots of each sequence's last block, from the token counts
    the engines reported and their block size (the share of allocated KV slots holding no token);
  - the engines' allocation failures: requests vLLM preempted because no free block was left
    (its KV freed and recomputed later: the re-allocation cost), per request served;
  - the directory's fragmentation: the share of indexed blocks whose parent is gone, which no
    prefix lookup can reach (`gaas kv stats`)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from bench.common import sse
from bench.sits.card import Dimension
from bench.sits.load import Outcome, stream, text
from bench.sits.target import Target

MODEL = "gaas-tiny"


async def churn(base_url: str, key: str, streams: int, seconds: float, seed: int = 3) -> list[Outcome]:
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    deadline = time.perf_counter() + seconds
    async with sse.session(base_url, connections=streams + 4, timeout=300) as c:
        async def loop(i: int) -> None:
            while time.perf_counter() < deadline:
                body = {"model": MODEL, "prompt": f"{i} {rng.random()} " + text(rng, rng.randint(100, 1400)),
                        "max_tokens": rng.randint(16, 400), "ignore_eos": True, "temperature": 0}
                outcomes.append(await stream(c, key, body))

        await asyncio.gather(*(loop(i) for i in range(streams)))
    return outcomes


def measure(t: Target, say, quick: bool = False) -> Dimension:
    d = Dimension("memory_fragmentation")
    _, key = t.tenant("churn", "gold")
    workers = t.workers(MODEL)
    if not workers:
        d.error = f"the target serves no {MODEL}"
        return d
    block_size = workers[0]["block_size"] or 16
    streams, seconds = (16, 12.0) if quick else (24, 25.0)
    before = {w["worker_id"]: w["load"]["preemptions"] for w in workers}
    peak: dict[str, float] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            for w in t.workers(MODEL):
                peak[w["worker_id"]] = max(peak.get(w["worker_id"], 0.0), w["load"]["kv_cache_usage"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    say(f"fragmentation: {streams} streams of random-length requests for {seconds:.0f} s "
        f"({workers[0]['load']['kv_cache_blocks']} KV blocks a worker)")
    try:
        outcomes = asyncio.run(churn(t.base_url, key, streams, seconds))
    finally:
        stop.set()
        sampler.join(timeout=5)
    time.sleep(1.0)  # the last KV events reach the directory
    after = t.workers(MODEL)
    stats = t.kv_stats() or {}
    served = [o for o in outcomes if o.ok]
    held = [o.prompt_tokens + o.completion_tokens for o in served]
    slots = sum(-(-n // block_size) * block_size for n in held)
    preempted = sum(w["load"]["preemptions"] - before.get(w["worker_id"], 0) for w in after)
    d.figures = {
        "requests": len(outcomes), "served": len(served), "block_size": block_size,
        "internal_fragmentation": round(1 - sum(held) / slots, 4) if slots else None,
        "preemptions": preempted,
        "preemptions_per_request": round(preempted / len(served), 4) if served else None,
        "kv_usage_peak": {w: round(v, 3) for w, v in sorted(peak.items())},
        "directory": {"blocks": int(stats.get("blocks", 0)),
                      "fragmentation": round(float(stats.get("fragmentation", 0.0)), 4),
                      "unreachable_blocks": sum(int(w.get("unreachable_blocks", 0))
                                                for w in stats.get("per_worker", ()))},
        "kv_blocks_per_worker": {w["worker_id"]: w["load"]["kv_cache_blocks"] for w in after},
        "definition": "seed 003: failed contiguous allocations and re-allocation cost; paged KV has no contiguous "
                      "allocation (no external fragmentation): internal = unused slots of last blocks, failures = "
                      "vLLM preemptions (no free block), directory = indexed blocks no lookup can reach",
    }
    f = d.figures
    d.cell = (f"{f['internal_fragmentation']:.1%} internal (paged KV: no external); "
              f"{f['preemptions']} preemptions in {f['served']} requests; "
              f"directory {f['directory']['fragmentation']:.1%} "
              "unreachable")
    return d
