"""Requests as a client sends them (streamed, through the ingress, over HTTP: bench.common.sse), timed
where the client sees them, and the text that fills their prompts to a given number of tokens."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from bench.common import sse

WORDS = ("river stone cloud harbor signal copper forest market ladder paper lamp window garden winter thread "
         "engine meadow silver canyon lantern orbit valley prism ember falcon glacier harvest island jasmine").split()


# Tokens per word of WORDS with the local models' tokenizers (byte-level BPE trained on Python's sources).
TOKENS_PER_WORD = 2.9


def text(rng: random.Random, tokens: int) -> str:
    """Random words, about `tokens` tokens of the local models' tokenizers."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / TOKENS_PER_WORD))))


@dataclass(slots=True)
class Outcome:
    ok: bool
    status: int = 200
    ttft_ms: float = 0.0
    ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    started: float = 0.0
    # Which class of request of the workload it was (heavy / light, a tier).
    kind: str = ""
    # What it streamed.
    text: str = ""
    # Where the mesh says its time went (gaas.contracts.latency's parts, ms), when asked (explain).
    parts: dict | None = None


async def stream(client: aiohttp.ClientSession, key: str, body: dict, *, chat: bool = False,
                 headers: Sequence = (), kind: str = "", explain: bool = False) -> Outcome:
    """One streamed completion (chat: a chat completion) with its usage: its TTFT and tokens (explain:
    and where the mesh says its time went, x-gaas-explain)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers = [*headers, ("x-gaas-explain", "1")] if explain else headers
    started = time.perf_counter()
    out = Outcome(ok=False, started=started, kind=kind)
    try:
        async with client.post("/v1/chat/completions" if chat else "/v1/completions", json=body,
                               headers=sse.bearer(key, dict(headers))) as r:
            out.status = r.status
            if r.status != 200:
                await r.read()
                out.ms = (time.perf_counter() - started) * 1000
                return out
            async for chunk in sse.events(r):
                if "error" in chunk:
                    out.ms = (time.perf_counter() - started) * 1000
                    return out
                choices = chunk.get("choices") or []
                if choices:
                    piece = choices[0].get("text") if not chat else (choices[0].get("delta") or {}).get("content")
                    if piece:
                        if not out.ttft_ms:
                            out.ttft_ms = (time.perf_counter() - started) * 1000
                        out.text += piece
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens", 0)
                    out.completion_tokens = usage.get("completion_tokens", 0)
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    out.parts = usage.get("gaas_latency_ms") or out.parts
    except sse.CLIENT_ERRORS:
        out.status = 0
        out.ms = (time.perf_counter() - started) * 1000
        return out
    out.ok = True
    out.ms = (time.perf_counter() - started) * 1000
    return out


async def open_loop(base_url: str, schedule: Sequence[tuple[float, Callable]], timeout: float = 300) -> list[Outcome]:
    """Each (at, send) of schedule started at its time (seconds from now), whatever the ones before
    are doing; send(client) -> Outcome. All of them once they ended."""
    async with sse.session(base_url, connections=1000, timeout=timeout) as client:
        start = time.perf_counter()
        tasks = []
        for at, send in schedule:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client)))
        return list(await asyncio.gather(*tasks))


async def closed_loop(base_url: str, concurrency: int, seconds: float, send: Callable,
                      timeout: float = 300) -> list[Outcome]:
    """concurrency clients each sending send(client) -> Outcome one after another for `seconds`: the
    outcomes of the requests that ended within that time (the ones still running then are awaited,
    not counted)."""
    async with sse.session(base_url, connections=concurrency + 10, timeout=timeout) as client:
        until = time.perf_counter() + seconds
        ended: list[Outcome] = []

        async def one_client() -> None:
            while time.perf_counter() < until:
                out = await send(client)
                if time.perf_counter() <= until:
                    ended.append(out)

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return ended


def poisson(rng: random.Random, rate: float, seconds: float, start: float = 0.0) -> list[float]:
    """Arrival times of a Poisson process at rate per second over [start, start + seconds)."""
    times, t = [], start
    while True:
        t += rng.expovariate(rate)
        if t >= start + seconds:
            return times
        times.append(t)
