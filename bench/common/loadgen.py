"""Streaming load as users of the official `openai` client make it: a few clients, each streaming
one completion after another through the ingress with the client's own defaults (max_retries=2:
a refused or reset connection, a 408, 409, 429 or 5xx answer is tried again after ~0.5 s and ~1 s),
recording each call: when it started, when its first token came, the tokens it received, the usage
its last chunk carried, how it ended, and every attempt's HTTP status.

A call is one `completions.create(stream=True)` with the client's retries inside it. It failed
before its first token when it raised, or its stream ended, before any token: what a user of the
client sees fail (an attempt the client retried and then served is not a failure; `retried`
counts them). It was cut mid-stream when it ended without its final usage chunk after a token."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

MODEL = "gaas-tiny"
# Each call asks for this many tokens, the end of text ignored: every stream is equally long.
MAX_TOKENS = 24


@dataclass(slots=True)
class Call:
    """One streamed completion as its client saw it."""

    # The x-request-id it was sent with (every attempt): the ledger's client_request_id.
    id: str
    # When it began and ended (time.monotonic()), and when its first token came (None: never).
    start: float
    end: float = 0.0
    first: float | None = None
    # Completion tokens received (one logprobs entry each: a chunk may carry more than one).
    tokens: int = 0
    # (prompt, cached, completion) from the final usage chunk; None when the stream did not end whole.
    usage: tuple[int, int, int] | None = None
    # What the client raised ("" when nothing).
    error: str = ""
    # Each attempt's HTTP status, in order (0: no answer, the connection refused or reset).
    statuses: list[int] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        """ok, before_first_token (failed before any token) or mid_stream (cut after one)."""
        if self.usage is not None and not self.error:
            return "ok"
        return "mid_stream" if self.tokens or self.first is not None else "before_first_token"


class Load:
    """`streams` clients streaming completions with `key` through the ingress at base_url (its /v1),
    in a thread of its own, until the block ends, each pausing `pause` seconds between its calls
    (0: one after another, as fast as the mesh serves them); calls: every call so far, ended ones."""

    def __init__(self, base_url: str, key: str, streams: int, pause: float = 0.0) -> None:
        self.calls: list[Call] = []
        self._base, self._key, self._streams, self._pause = base_url, key, streams, pause
        self._tag = uuid.uuid4().hex[:8]
        self._open: dict[str, Call] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def since(self, t: float) -> list[Call]:
        return [c for c in self.calls if c.end >= t]

    async def _run(self) -> None:
        import openai

        async def sent(request) -> None:
            if call := self._open.get(request.headers.get("x-request-id", "")):
                call.statuses.append(0)

        async def answered(response) -> None:
            call = self._open.get(response.request.headers.get("x-request-id", ""))
            if call is not None and call.statuses:
                call.statuses[-1] = response.status_code

        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [sent], "response": [answered]})
        async with openai.AsyncOpenAI(base_url=f"{self._base}/v1", api_key=self._key, timeout=60,
                                      http_client=http) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self._streams)))

    async def _client(self, client, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            call = await self._one(client, f"soak-{self._tag}-{i}-{n}", f"soak {i}.{n}: tell me about the sea")
            self.calls.append(call)
            # A user sends again a moment after a failure, as the client's own retries do.
            await asyncio.sleep(max(self._pause, 0.0 if call.outcome == "ok" else 0.1))

    async def _one(self, client, rid: str, prompt: str) -> Call:
        import openai

        call = self._open[rid] = Call(rid, time.monotonic())
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, logprobs=1,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                extra_headers={"x-request-id": rid})
            async for chunk in stream:
                for choice in chunk.choices:
                    got = len(choice.logprobs.tokens or []) if choice.logprobs else 0
                    if (got or choice.text) and call.first is None:
                        call.first = time.monotonic()
                    call.tokens += got
                if chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details
                    call.usage = (chunk.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0,
                                  chunk.usage.completion_tokens)
        except openai.APIError as exc:
            call.error = f"{type(exc).__name__}: {exc}"[:200]
        except Exception as exc:  # noqa: BLE001 - whatever ends a call is its outcome, recorded
            call.error = f"{type(exc).__name__}: {exc}"[:200]
        call.end = time.monotonic()
        del self._open[rid]
        return call


def tally(calls: list[Call]) -> dict:
    """What calls came to: requests, how many ended each way, retried (calls the client served only
    after trying again), 429s (attempts answered so), and the errors seen (at most 5)."""
    outcomes = Counter(c.outcome for c in calls)
    failed = [c for c in calls if c.outcome != "ok"]
    return {
        "requests": len(calls),
        "failed_before_first_token": outcomes["before_first_token"],
        "cut_mid_stream": outcomes["mid_stream"],
        "retried": sum(1 for c in calls if c.outcome == "ok" and len(c.statuses) > 1),
        "answered_429": sum(c.statuses.count(429) for c in calls),
        "errors": sorted({c.error or f"ended after {c.tokens} tokens without its usage" for c in failed})[:5],
    }
