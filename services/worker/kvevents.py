"""The engine's KV events, relayed to whoever watches this worker (the KV directories).

vLLM publishes BlockStored / BlockRemoved / AllBlocksCleared batches on a local ZMQ socket, each
with a sequence number, and keeps the last ones for replay on a second socket. The relay
subscribes, follows the sequence (a gap is filled from the replay socket), keeps a mirror of
every block the engine holds, and serves each watcher a snapshot of that mirror followed by the
live batches. When events are lost beyond what replay holds, nothing can say which blocks the
engine still has: the relay starts a new epoch with an empty mirror and asks the engine to drop
its prefix cache, so no directory ever believes in a block the engine no longer holds.

The ZMQ side is behind EventSource, so the relay is tested with scripted batches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from gaas.contracts import errors
from gaas.runtime.streams import until_cut_off
from gaas.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

# Blocks per snapshot batch (each carries its tokens: ~0.2 MB per 1,000 blocks of 32).
SNAPSHOT_CHUNK = 2000
# Batches a slow watcher may fall behind before it is cut off (it reconnects and gets a snapshot).
WATCHER_QUEUE = 10_000
# A quiet watch gets an empty batch this often, so no proxy takes it for an idle stream.
HEARTBEAT_SECONDS = 20.0


@dataclass(frozen=True, slots=True)
class RawStored:
    engine_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    cache_salt: str
    lora_name: str


@dataclass(frozen=True, slots=True)
class RawBatch:
    seq: int
    # RawStored, ("removed", [hashes]) or ("cleared",)
    events: list
    # When the engine emitted it, Unix seconds (0: unknown).
    emitted_unix: float = 0.0


class EventSource(ABC):
    """Where the engine's batches come from."""

    @abstractmethod
    async def next(self) -> RawBatch: ...

    @abstractmethod
    async def replay(self, start_seq: int) -> list[RawBatch]:
        """The kept batches from start_seq on (may start later: older ones are gone)."""

    def close(self) -> None:  # noqa: B027 - optional
        pass


def _salt_and_lora(extra_keys, lora_name: str | None) -> tuple[str, str]:
    """The cache salt vLLM keyed a first block with: extra_keys[0] holds the LoRA name (when
    lora_name is set), multimodal pairs, then the salt string."""
    lora = lora_name or ""
    keys = list((extra_keys or [None])[0] or ())
    if lora and keys and keys[0] == lora:
        keys = keys[1:]
    salt = next((k for k in keys if isinstance(k, str)), "")
    return salt, lora


def from_vllm(seq: int, batch) -> RawBatch:
    """A vLLM KVEventBatch as a RawBatch."""
    events: list = []
    for e in batch.events:
        kind = type(e).__name__
        if kind == "BlockStored":
            salt, lora = _salt_and_lora(e.extra_keys, e.lora_name) if e.parent_block_hash is None else ("", e.lora_name or "")
            events.append(RawStored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, salt, lora))
        elif kind == "BlockRemoved":
            events.append(("removed", list(e.block_hashes)))
        elif kind == "AllBlocksCleared":
            events.append(("cleared",))
    return RawBatch(seq, events, float(getattr(batch, "ts", 0.0) or 0.0))


class ZmqEventSource(EventSource):
    """vLLM's ZMQ publisher (PUB socket, ROUTER replay socket)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._replay_endpoint = replay_endpoint
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode

    async def next(self) -> RawBatch:
        _, seq, payload = await self._sub.recv_multipart()
        return from_vllm(int.from_bytes(seq, "big"), self._decode(payload))

    async def replay(self, start_seq: int) -> list[RawBatch]:
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.connect(self._replay_endpoint)
        out: list[RawBatch] = []
        try:
            await sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout=2.0)
                _, _, seq, payload = frames[-4:] if len(frames) >= 4 else (None, None, b"", b"")
                if int.from_bytes(seq, "big", signed=True) == -1 or not payload:
                    return out
                out.append(from_vllm(int.from_bytes(seq, "big"), self._decode(payload)))
        except asyncio.TimeoutError:
            log.warning("the engine's replay socket did not finish answering")
            return out
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


@dataclass(slots=True)
class _Block:
    parent: int | None
    token_ids: array
    block_size: int
    cache_salt: str
    lora_name: str


class KVEventRelay:
    """Follows one engine's KV events; watch() serves them to a directory."""

    def __init__(
        self,
        worker_id: str,
        source: EventSource,
        reset_engine_cache: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self._source = source
        self._reset_engine_cache = reset_engine_cache
        # Changes when the account starts over: a restarted worker, or lost events.
        self.epoch = time.time_ns()
        self.last_seq = -1
        # Engine hash -> block, in the order stored (parents before their children).
        self._mirror: dict[int, _Block] = {}
        self._watchers: set[asyncio.Queue] = set()
        # Stopping: no watch is taken, and those running have ended (close()).
        self._closed = False
        self.batches = 0
        self.lost = 0

    @property
    def blocks(self) -> int:
        return len(self._mirror)

    async def run(self) -> None:
        """Follow the engine's batches until cancelled."""
        while True:
            batch = await self._source.next()
            if self.last_seq >= 0 and batch.seq <= self.last_seq:
                continue  # already seen (a replayed one)
            if self.last_seq >= 0 and batch.seq != self.last_seq + 1:
                missing = await self._source.replay(self.last_seq + 1)
                missing = [b for b in missing if self.last_seq < b.seq < batch.seq]
                if [b.seq for b in missing] != list(range(self.last_seq + 1, batch.seq)):
                    await self._start_over(f"batches {self.last_seq + 1}-{batch.seq - 1} are gone even from the replay buffer")
                else:
                    for b in missing:
                        self._apply(b)
            self._apply(batch)

    def _apply(self, batch: RawBatch) -> None:
        self.last_seq = batch.seq
        self.batches += 1
        out = pb.KVEventBatch(worker_id=self.worker_id, seq=batch.seq, epoch=self.epoch,
                              emitted_unix=batch.emitted_unix)
        for e in batch.events:
            if isinstance(e, RawStored):
                parent = e.parent
                for i, h in enumerate(e.engine_hashes):
                    tokens = array("I", e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                    self._mirror[h] = _Block(parent, tokens, e.block_size, e.cache_salt if i == 0 else "", e.lora_name)
                    parent = h
                out.events.add(stored=_stored_pb(e))
            elif e[0] == "removed":
                for h in e[1]:
                    self._mirror.pop(h, None)
                out.events.add(removed=pb.BlockRemoved(block_hashes=e[1]))
            elif e[0] == "cleared":
                self._mirror.clear()
                out.events.add(cleared=pb.AllBlocksCleared())
        self._publish(out)

    def _publish(self, out: pb.KVEventBatch | None) -> None:
        for q in list(self._watchers):
            try:
                q.put_nowait(out)
            except asyncio.QueueFull:
                log.warning("a KV watcher fell %d batches behind; cutting it off (it will resynchronise)", WATCHER_QUEUE)
                self._end(q)

    def _end(self, q: asyncio.Queue) -> None:
        """Cut a watcher off: it ends its watch and resynchronises."""
        self._watchers.discard(q)
        while q.full():
            q.get_nowait()
        q.put_nowait(None)

    async def _start_over(self, why: str) -> None:
        """Events were lost: nothing says which blocks the engine still holds. Start a new epoch
        from nothing (watchers resynchronise to an empty account) and clear the engine's cache."""
        self.lost += 1
        log.error("KV events lost (%s): starting over with an empty account and clearing the engine's prefix cache", why)
        self.epoch = time.time_ns()
        self._mirror.clear()
        for q in list(self._watchers):
            self._end(q)
        if self._reset_engine_cache is not None:
            try:
                if not await self._reset_engine_cache():
                    log.warning("the engine could not clear its prefix cache now; blocks it still holds stay unindexed")
            except Exception as exc:  # noqa: BLE001 - the account is safe either way
                log.warning("clearing the engine's prefix cache failed: %s", exc)

    def snapshot(self) -> list[pb.KVEventBatch]:
        """Everything held now, as batches marked snapshot; their seq is the sequence number the
        next live batch will carry."""
        batches = []
        items = list(self._mirror.items())
        for start in range(0, max(len(items), 1), SNAPSHOT_CHUNK):
            b = pb.KVEventBatch(worker_id=self.worker_id, seq=self.last_seq + 1, epoch=self.epoch, snapshot=True)
            for h, blk in items[start : start + SNAPSHOT_CHUNK]:
                stored = pb.BlockStored(
                    block_hashes=[h], token_ids=blk.token_ids.tolist(), block_size=blk.block_size,
                    cache_salt=blk.cache_salt, lora_name=blk.lora_name,
                )
                if blk.parent is not None:
                    stored.parent_block_hash = blk.parent
                b.events.add(stored=stored)
            batches.append(b)
        return batches

    def close(self) -> None:
        """The worker is stopping: every watch ends now (its server need not wait its grace for
        the directories to hang up) and no new one is taken."""
        self._closed = True
        for q in list(self._watchers):
            self._end(q)

    async def watch(self) -> AsyncIterator[pb.KVEventBatch]:
        """A snapshot of the held blocks, then every batch as it comes (and an empty one after
        HEARTBEAT_SECONDS of quiet); ends when the watcher must resynchronise (it watches again),
        or when the worker stops (close(): Unavailable for a watch begun after)."""
        if self._closed:
            raise errors.Unavailable("this worker is stopping; its KV events end with it")
        q: asyncio.Queue = asyncio.Queue(maxsize=WATCHER_QUEUE)
        snapshot = self.snapshot()  # taken and registered with no await between: nothing slips by
        self._watchers.add(q)
        try:
            for b in snapshot:
                yield b
            async for b in until_cut_off(q, HEARTBEAT_SECONDS, lambda: pb.KVEventBatch(
                    worker_id=self.worker_id, seq=self.last_seq + 1, epoch=self.epoch)):
                yield b
        finally:
            self._watchers.discard(q)


def _stored_pb(e: RawStored) -> pb.BlockStored:
    out = pb.BlockStored(
        block_hashes=e.engine_hashes, token_ids=e.token_ids, block_size=e.block_size,
        cache_salt=e.cache_salt, lora_name=e.lora_name,
    )
    if e.parent is not None:
        out.parent_block_hash = e.parent
    return out
