"""The worker registry: registrations with leases that lapse unless renewed, kept in Redis so
every control replica (and a restarted one) sees the same workers.

A lease can only be renewed while some control replica answers. When none did for a while (all
stopped, paused, restarting), the leases that were live when the last one went quiet are extended by
one TTL as soon as one answers again, as etcd does for its leases on a leader change: workers are not
dropped from every router's view for a gap that was control's, not theirs."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import redis.asyncio as aioredis

from gaas.contracts import errors
from gaas.contracts.ids import WorkerId

from gaas.contracts.services import REGISTRY_CHANGED_CHANNEL

log = logging.getLogger(__name__)

SERVING = "serving"
DRAINING = "draining"
STATES = (SERVING, DRAINING)

_KEY = "gaas:worker:{}"  # one JSON record per worker, kept RETAIN_SECONDS past its lease
_INDEX = "gaas:workers"  # sorted set: worker id -> lease expiry (ms): the lease's truth
_ALIVE = "gaas:control:alive"  # Unix ms of the latest call any control replica handled
# Published when a worker registers, leaves or changes state: routers read the registry again at
# once instead of at their next refresh, so none routes to a worker the Envoys' membership (xDS,
# pushed at once too) no longer has.
CHANGED_CHANNEL = REGISTRY_CHANGED_CHANNEL

# A record outlives its lease this long, so a lease that lapsed in a gap of control can be extended.
RETAIN_SECONDS = 300
# Control silent longer than this (no call handled, no heartbeat) was a gap.
GAP_MS = 3000

# KEYS: alive, index. ARGV: now ms, gap ms, ttl ms, retain ms. Records the heartbeat; after a gap,
# extends every lease still live when the gap began to now + ttl. Returns how many it extended.
_HEARTBEAT = """
local prev = tonumber(redis.call('GET', KEYS[1]))
local now, gap, ttl, retain = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if prev and prev >= now then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', retain)
if not prev or now - prev <= gap then return 0 end
local live = redis.call('ZRANGEBYSCORE', KEYS[2], prev, '+inf', 'WITHSCORES')
local n = 0
for i = 1, #live, 2 do
  if tonumber(live[i + 1]) < now + ttl then
    redis.call('ZADD', KEYS[2], now + ttl, live[i])
    n = n + 1
  end
end
return n
"""


class LeaseExpired(errors.NotFound):
    """The worker has no live registration (never registered, deregistered, or lapsed)."""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    # Stable id ("worker-0").
    worker_id: WorkerId
    # Sidecar inbound host:port: what the router names in x-gaas-worker.
    address: str
    # Served model name and version.
    model: str
    model_version: str
    # "vllm-cpu" or "vllm-cuda".
    backend: str
    # Human-readable device.
    device: str
    # Engine KV block size, tokens.
    block_size: int
    # Engine context limit, tokens.
    max_model_len: int
    # SERVING or DRAINING.
    state: str = SERVING
    # Lease end and first registration, Unix ms.
    lease_expires_ms: int = 0
    registered_ms: int = 0
    # Version of the engine (vLLM) the worker runs.
    engine_version: str = ""
    # Its latest load report, as gaas.v1.WorkerLoad's JSON mapping (renewals carry it).
    load: dict = field(default_factory=dict)


def _now_ms() -> int:
    return int(time.time() * 1000)


class WorkerRegistry:
    def __init__(self, redis: aioredis.Redis, ttl_seconds: int, clock: Callable[[], int] = _now_ms) -> None:
        if ttl_seconds < 1:
            raise ValueError("lease TTL must be at least 1 second")
        self._redis = redis
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._heartbeat_script = redis.register_script(_HEARTBEAT)

    async def heartbeat(self) -> int:
        """Says control answers (every call does, and a timer every second); after a gap in which
        none did, extends the leases that were live when it began. Returns how many it extended."""
        extended = int(await self._heartbeat_script(
            keys=[_ALIVE, _INDEX],
            args=[self._clock(), GAP_MS, self.ttl_seconds * 1000, RETAIN_SECONDS * 1000],
        ))
        if extended:
            log.warning("control was silent for a while: extended %d worker lease(s) by %d s", extended, self.ttl_seconds)
        return extended

    async def register(self, record: WorkerRecord) -> WorkerRecord:
        await self.heartbeat()
        now = self._clock()
        prev = await self._get(record.worker_id)
        record = replace(
            record,
            lease_expires_ms=now + self.ttl_seconds * 1000,
            registered_ms=prev.registered_ms if prev and prev.address == record.address else now,
        )
        await self._put(record)
        await self._announce()
        return record

    async def _announce(self) -> None:
        try:
            await self._redis.publish(CHANGED_CHANNEL, "1")
        except Exception as exc:  # noqa: BLE001 - the routers' own refresh catches up
            log.debug("cannot announce a registry change: %s", exc)

    async def renew(self, worker_id: WorkerId, state: str | None = None, load: dict | None = None) -> WorkerRecord:
        await self.heartbeat()
        record = await self._get(worker_id)
        expires = await self._redis.zscore(_INDEX, worker_id)
        if record is None or expires is None or expires < self._clock():
            raise LeaseExpired(f"worker {worker_id!r} has no live lease; register again")
        if state is not None and state not in STATES:
            raise ValueError(f"unknown worker state {state!r}")
        changed = state is not None and state != record.state
        record = replace(
            record,
            state=state or record.state,
            lease_expires_ms=self._clock() + self.ttl_seconds * 1000,
            load=record.load if load is None else load,
        )
        await self._put(record)
        if changed:
            await self._announce()
        return record

    async def deregister(self, worker_id: WorkerId) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(_KEY.format(worker_id))
            pipe.zrem(_INDEX, worker_id)
            deleted, _ = await pipe.execute()
        if deleted:
            await self._announce()
        return bool(deleted)

    async def list(self, model: str = "") -> list[WorkerRecord]:
        await self.heartbeat()
        now = self._clock()
        await self._redis.zremrangebyscore(_INDEX, "-inf", now - RETAIN_SECONDS * 1000)
        live = await self._redis.zrangebyscore(_INDEX, now, "+inf", withscores=True)
        if not live:
            return []
        raw = await self._redis.mget([_KEY.format(i) for i, _ in live])
        records = [replace(self._decode(r), lease_expires_ms=int(expires)) for r, (_, expires) in zip(raw, live) if r]
        return sorted((r for r in records if not model or r.model == model), key=lambda r: r.worker_id)

    async def _get(self, worker_id: WorkerId) -> WorkerRecord | None:
        raw = await self._redis.get(_KEY.format(worker_id))
        return self._decode(raw) if raw else None

    async def _put(self, record: WorkerRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(_KEY.format(record.worker_id), json.dumps(asdict(record)),
                     px=(self.ttl_seconds + RETAIN_SECONDS) * 1000)
            pipe.zadd(_INDEX, {record.worker_id: record.lease_expires_ms})
            await pipe.execute()

    @staticmethod
    def _decode(raw: str) -> WorkerRecord:
        return WorkerRecord(**json.loads(raw))
