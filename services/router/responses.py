"""Stored responses (OpenAI's Responses API, store: true) in Redis, under the tenant's namespace
(gaas.contracts.sessions: response_key, responses_index_key): what GET /v1/responses/{id} answers
and what previous_response_id continues. A tenant sees only its own: another's id is not found.

A background response is stored at once, in_progress, with a lease its runner renews (every
LEASE_RENEW_S, for LEASE_S) until it stores the end; one whose lease lapsed (its router stopped)
reads as failed. Its cancel is a key the runner looks at with each renewal, on whichever router.

What a tenant stores is counted in bytes with its sessions (gaas.contracts.tenantbytes): a response
that would take it past the policy's max_bytes_per_tenant is refused with 429, and room() refuses
one before its generation when the tenant already holds its most."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.contracts import errors, tenantbytes, usage as metering
from gaas.contracts.sessions import (
    RESPONSE_DELETE, RESPONSE_ID_RE, RESPONSE_PUT, SessionPolicy, response_cancel_key, response_key,
    responses_index_key,
)
from gaas.runtime.redisconn import Script

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
    def __init__(self, redis: Redis, policy: SessionPolicy, clock: Callable[[], int] = metering.now_ms) -> None:
        self._redis = redis
        self._policy = policy
        self._clock = clock
        self._put = Script(redis, RESPONSE_PUT)
        self._delete = Script(redis, RESPONSE_DELETE)
        self._held = Script(redis, tenantbytes.HELD)

    async def put(self, tenant: str, response_id: str, record: dict) -> int:
        """Keep record ({"response", "input_items", "conversation", "v"}) for the policy's TTL;
        past the tenant's most, its oldest stored responses go. The bytes the tenant then holds;
        errors.ResourceExhausted (nothing written) when it would hold more than its most."""
        ttl = self._policy.response_ttl_seconds * 1000
        try:
            answer = await self._put(
                keys=[response_key(tenant, response_id), responses_index_key(tenant), tenantbytes.held_key(tenant),
                      tenantbytes.held_until_key(tenant)],
                args=[self._clock(), ttl, json.dumps(record, separators=(",", ":")), response_id,
                      self._policy.max_responses_per_tenant, self._policy.max_bytes_per_tenant,
                      response_key(tenant, "")])
        except RedisError as exc:
            raise _unavailable(exc) from None
        if int(answer[0]) < 0:
            raise tenantbytes.refused(tenant, int(answer[1]), int(answer[2]), "storing this response")
        return int(answer[0])

    async def held(self, tenant: str) -> int:
        """The bytes the tenant holds in stored responses and sessions now."""
        try:
            return int(await self._held(keys=[tenantbytes.held_key(tenant), tenantbytes.held_until_key(tenant)],
                                        args=[self._clock()]))
        except RedisError as exc:
            raise _unavailable(exc) from None

    async def room(self, tenant: str, record: dict) -> None:
        """errors.ResourceExhausted when the tenant has no room left for record as it is before its
        generation (asked first, so a tenant at its cap spends no tokens on a response it cannot keep)."""
        cap = self._policy.max_bytes_per_tenant
        if not cap:
            return
        need = len(json.dumps(record, separators=(",", ":")).encode()) + tenantbytes.ENTRY_OVERHEAD
        if (held := await self.held(tenant)) + need > cap:
            raise tenantbytes.refused(tenant, held, cap, "storing another response")

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
            deleted = await self._delete(
                keys=[response_key(tenant, response_id), responses_index_key(tenant), tenantbytes.held_key(tenant),
                      tenantbytes.held_until_key(tenant)],
                args=[response_id, self._clock()])
        except RedisError as exc:
            raise _unavailable(exc) from None
        if not int(deleted):
            raise not_found(response_id)
