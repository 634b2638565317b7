"""The load generators' HTTP client for streamed OpenAI requests: aiohttp, and each `data:` event of
an answer as a dict.

The benchmarks that load the mesh from this same 2-core host (the scorecard, `bench.qos`) share its
cores with what they measure, so what the client spends is taken from the mesh. Measured here (one
local server streaming 33 events per request, 600 requests 150 at a time): httpx's AsyncClient spent
28.7 ms of CPU per request, aiohttp 2.5 ms; at the scorecard's 30 requests/s, httpx alone took most
of a core and its own lag put 25-30 s into the TTFT the client saw."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping

import aiohttp

# What a failed call raises: the connection's or the protocol's error, or the session's timeout.
CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def session(base_url: str, *, connections: int = 100, timeout: float = 300) -> aiohttp.ClientSession:
    """A session to base_url holding up to `connections` at once, every call within `timeout` s."""
    return aiohttp.ClientSession(
        base_url=base_url, connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        timeout=aiohttp.ClientTimeout(total=timeout))


async def events(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """Each `data:` event of a streamed answer, parsed, up to `[DONE]`."""
    async for raw in response.content:
        if not raw.startswith(b"data: "):
            continue
        data = raw[6:].rstrip(b"\r\n")
        if data == b"[DONE]":
            return
        yield json.loads(data)


def bearer(key: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers of a call with an API key (and any others)."""
    return {"authorization": f"Bearer {key}", **(extra or {})}
