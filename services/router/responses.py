"""Stored responses (OpenAI's Responses API, store: true) in Redis, under the tenant's namespace
(gaas.contracts.sessions: response_key, responses_index_key): what GET /v1/responses/{id} answers
and what previous_response_id continues. A tenant sees only its own: another's id is not found.

A background response is stored at once, in_progress, with a lease its runner renews (every
LEASE_RENEW_S, for LEASE_S) until it stores the end; one whose lease lapsed (its router stopped)
reads as failed. Its cancel is a key the runner looks at with each renewal, on whichever router."""

from __future__ import annotations

import json
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.contracts import errors
from gaas.contracts.sessions import (
    RESPONSE_ID_RE, SessionPolicy, response_cancel_key, response_key, responses_index_key,
)

log = logging.getLogger(__name__)

# A background response's lease: renewed this often by its runner, lapsing this long after.
LEASE_RENEW_S = 1.0
LEASE_S = 10.0


def not_found(response_id: str, param: str | None = None) -> errors.NotFound:
    return errors.NotFound(f"no response {errors.quote(response_id)}: it was never stored (\"store\": false), was "
                           "deleted, or expired", param=param, reason="response_not_found")


def _unavailable(exc: RedisError) -> errors.Unavailable:
    log.warning("stored responses: Redis refused or did not answer (%s)", exc)
    return errors.Unavailable("stored responses cannot be reached now (Redis does not answer); retry shortly",
                              retry_after=1.0)


class ResponseStore:
    def __init__(self, redis: Redis, policy: SessionPolicy) -> None:
        self._redis = redis
        self._policy = policy

    async def put(self, tenant: str, response_id: str, record: dict) -> None:
        """Keep record ({"response", "input_items", "conversation", "v"}) for the policy's TTL;
        past the tenant's most, its oldest stored responses go."""
        now = int(time.time() * 1000)
        ttl = self._policy.response_ttl_seconds * 1000
        index = responses_index_key(tenant)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(response_key(tenant, response_id), json.dumps(record, separators=(",", ":")), px=ttl)
                pipe.zadd(index, {response_id: now + ttl})
                pipe.zremrangebyscore(index, "-inf", now)
                pipe.pexpire(index, ttl)
                pipe.zcard(index)
                *_, count = await pipe.execute()
            if count > self._policy.max_responses_per_tenant:
                gone = await self._redis.zpopmin(index, count - self._policy.max_responses_per_tenant)
                if gone:
                    await self._redis.delete(*(response_key(tenant, rid.decode() if isinstance(rid, bytes) else rid)
                                               for rid, _ in gone))
        except RedisError as exc:
            raise _unavailable(exc) from None

    async def get(self, tenant: str, response_id: str, param: str | None = None) -> dict:
        if not RESPONSE_ID_RE.fullmatch(response_id):
            raise not_found(response_id, param)
        try:
            raw = await self._redis.get(response_key(tenant, response_id))
        except RedisError as exc:
            raise _unavailable(exc) from None
        if raw is None:
            raise not_found(response_id, param)
        record = json.loads(raw)
        response = record["response"]
        if response["status"] in ("queued", "in_progress") and record.get("lease_until_ms", 0) < time.time() * 1000:
            response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": "the router running this background response "
                                 "stopped before it finished; create it again"}
        return record

    async def lease(self, tenant: str, response_id: str, record: dict) -> bool:
        """Store a background response's progress with its lease renewed; False once its cancel
        was asked for (then nothing is written: the cancel wrote the end)."""
        if await self.cancel_asked(tenant, response_id):
            return False
        record["lease_until_ms"] = int((time.time() + LEASE_S) * 1000)
        await self.put(tenant, response_id, record)
        return True

    async def cancel_asked(self, tenant: str, response_id: str) -> bool:
        try:
            return bool(await self._redis.exists(response_cancel_key(tenant, response_id)))
        except RedisError as exc:
            raise _unavailable(exc) from None

    async def ask_cancel(self, tenant: str, response_id: str, record: dict) -> None:
        """Mark a background response cancelled (its runner stops at its next look) and store it so."""
        try:
            await self._redis.set(response_cancel_key(tenant, response_id), "1",
                                  px=self._policy.response_ttl_seconds * 1000)
        except RedisError as exc:
            raise _unavailable(exc) from None
        record["response"]["status"] = "cancelled"
        await self.put(tenant, response_id, record)

    async def delete(self, tenant: str, response_id: str) -> None:
        if not RESPONSE_ID_RE.fullmatch(response_id):
            raise not_found(response_id)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(response_key(tenant, response_id))
                pipe.zrem(responses_index_key(tenant), response_id)
                deleted, _ = await pipe.execute()
        except RedisError as exc:
            raise _unavailable(exc) from None
        if not deleted:
            raise not_found(response_id)
