"""Streams of a request taken together, for whoever serves one: a request's several prompts'
streams as one (the router on its own route, the worker on the direct path); and a subscriber's
queue as a stream with heartbeats (a watch of KV events, a follow of the KV directory)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from gaas.v1 import common_pb2

T = TypeVar("T")

# The prompts of one request that are generated at once (the others wait their turn here, not in
# the workers' queues).
PARTS_AT_ONCE = 8


async def merge(streams: list[AsyncIterator[common_pb2.GenerateChunk]],
                at_once: int = PARTS_AT_ONCE) -> AsyncIterator[tuple[int, common_pb2.GenerateChunk]]:
    """(which stream, chunk) of several streams as their chunks arrive; the first failure ends all.
    At most at_once streams run at a time (a stream starts when it is first read: a request's
    prompts go to the workers a few at a time, in order). Bounded: while the consumer (a slow
    client) is behind, the streams wait, and the workers' streams with them, rather than their
    chunks piling up here."""
    if len(streams) == 1:
        async for c in streams[0]:
            yield 0, c
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(streams))
    turns = asyncio.Semaphore(max(1, at_once))
    done = object()

    async def pump(i: int, s: AsyncIterator) -> None:
        try:
            async with turns:
                async for c in s:
                    await queue.put((i, c))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, who re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_cut_off(q: asyncio.Queue, heartbeat_s: float, heartbeat: Callable[[], T]) -> AsyncIterator[T]:
    """A subscriber's queue as a stream: its items as they come, heartbeat() after heartbeat_s of
    quiet (so no proxy takes the stream for an idle one), until None (its producer cut it off)."""
    while True:
        try:
            item = await asyncio.wait_for(q.get(), heartbeat_s)
        except asyncio.TimeoutError:
            yield heartbeat()
            continue
        if item is None:
            return
        yield item
