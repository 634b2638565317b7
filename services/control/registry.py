"""The worker registry: registrations with leases that lapse unless renewed, kept in Redis so
every control replica (and a restarted one) sees the same workers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import NewType

import redis.asyncio as aioredis

from gaas import errors

WorkerId = NewType("WorkerId", str)

SERVING = "serving"
DRAINING = "draining"
STATES = (SERVING, DRAINING)

_KEY = "gaas:worker:{}"  # one JSON record per worker, expiring with its lease
_INDEX = "gaas:workers"  # sorted set: worker id -> lease expiry (ms), for listing


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

    async def register(self, record: WorkerRecord) -> WorkerRecord:
        now = self._clock()
        prev = await self._get(record.worker_id)
        record = replace(
            record,
            lease_expires_ms=now + self.ttl_seconds * 1000,
            registered_ms=prev.registered_ms if prev and prev.address == record.address else now,
        )
        await self._put(record)
        return record

    async def renew(self, worker_id: WorkerId, state: str | None = None, load: dict | None = None) -> WorkerRecord:
        record = await self._get(worker_id)
        if record is None:
            raise LeaseExpired(f"worker {worker_id!r} has no live lease; register again")
        if state is not None and state not in STATES:
            raise ValueError(f"unknown worker state {state!r}")
        record = replace(
            record,
            state=state or record.state,
            lease_expires_ms=self._clock() + self.ttl_seconds * 1000,
            load=record.load if load is None else load,
        )
        await self._put(record)
        return record

    async def deregister(self, worker_id: WorkerId) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(_KEY.format(worker_id))
            pipe.zrem(_INDEX, worker_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def list(self, model: str = "") -> list[WorkerRecord]:
        now = self._clock()
        await self._redis.zremrangebyscore(_INDEX, "-inf", now)
        ids = await self._redis.zrangebyscore(_INDEX, now, "+inf")
        if not ids:
            return []
        raw = await self._redis.mget([_KEY.format(i) for i in ids])
        records = [self._decode(r) for r in raw if r]
        return sorted((r for r in records if not model or r.model == model), key=lambda r: r.worker_id)

    async def _get(self, worker_id: WorkerId) -> WorkerRecord | None:
        raw = await self._redis.get(_KEY.format(worker_id))
        return self._decode(raw) if raw else None

    async def _put(self, record: WorkerRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(_KEY.format(record.worker_id), json.dumps(asdict(record)), px=self.ttl_seconds * 1000)
            pipe.zadd(_INDEX, {record.worker_id: record.lease_expires_ms})
            await pipe.execute()

    @staticmethod
    def _decode(raw: str) -> WorkerRecord:
        return WorkerRecord(**json.loads(raw))
