"""Who is calling: the API key from the Authorization header, looked up in the control plane and
cached briefly (a revoked key stops working within the cache's TTL, a few seconds).

While control cannot be asked, a key verified in the last stale_seconds is still accepted: by this
router's own cache, else by the routers' shared one in Redis (SharedKeys), so that a router
restarted while control is away serves the keys its peers verified.

Verified keys and unknown ones are cached apart: a flood of made-up keys fills only the cache of
unknown ones, never evicting the verified keys that keep tenants served while control is away.
And a client address that keeps sending unknown keys is slowed (FailedAuthLimiter): past a burst,
its keys are no longer looked up at all (429, with when to retry), unless they were verified
before."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from gaas.contracts import edge
from gaas.contracts.errors import GaasError, ResourceExhausted, Unauthenticated
from gaas.contracts.principal import Principal
from gaas.contracts.qos import Limits

log = logging.getLogger(__name__)

# While control does not answer, how often a request still tries it (the others use what was verified).
RECHECK_SECONDS = 1.0


def bearer_key(authorization: str) -> str:
    """The key of an 'Authorization: Bearer <key>' value."""
    if not authorization:
        raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <your key>'")
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <your key>'")
    return key.strip()


class FailedAuthLimiter:
    """A token bucket per client address, spent by each unknown or revoked key it sends: burst
    failures at once, then per_second. Bounded: the least recently seen addresses are forgotten."""

    def __init__(self, burst: int = edge.FAILED_AUTH_BURST, per_second: float = edge.FAILED_AUTH_PER_SECOND,
                 max_addresses: int = edge.FAILED_AUTH_ADDRESSES, clock: Callable[[], float] = time.monotonic) -> None:
        self._burst = float(burst)
        self._rate = per_second
        self._max = max_addresses
        self._clock = clock
        # address -> (tokens, when they were counted)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _tokens(self, address: str) -> float:
        tokens, at = self._buckets.get(address, (self._burst, self._clock()))
        return min(self._burst, tokens + (self._clock() - at) * self._rate)

    def retry_after(self, address: str) -> float:
        """0 while address may still fail; else the seconds until it may again."""
        if not address or address not in self._buckets:
            return 0.0
        tokens = self._tokens(address)
        return 0.0 if tokens >= 1 else (1 - tokens) / self._rate

    def failed(self, address: str) -> None:
        if not address:
            return
        self._buckets[address] = (self._tokens(address) - 1, self._clock())
        self._buckets.move_to_end(address)
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)


class SharedKeys:
    """Keys any router verified with control in the last stale_seconds, in Redis by their sha256
    (never in plain text), with whom they belong to and when they were verified; a revoked key is
    forgotten at once. Read only while control cannot be asked."""

    PREFIX = "gaas:auth:verified:"

    def __init__(self, redis, stale_seconds: float) -> None:
        self._redis = redis
        self._stale_ms = max(1, int(stale_seconds * 1000))

    async def remember(self, digest: str, p: Principal) -> None:
        value = json.dumps({"tenant": p.tenant, "tier": p.tier, "key_id": p.key_id, "cache_salt": p.cache_salt,
                            "limits": [p.limits.rpm, p.limits.tpm, p.limits.concurrency], "at": time.time()})
        await self._redis.set(self.PREFIX + digest, value, px=self._stale_ms)

    async def forget(self, digest: str) -> None:
        await self._redis.delete(self.PREFIX + digest)

    async def recall(self, digest: str) -> tuple[Principal, float] | None:
        """(its Principal, seconds since a router verified it), or None."""
        raw = await self._redis.get(self.PREFIX + digest)
        if raw is None:
            return None
        v = json.loads(raw)
        return (Principal(v["tenant"], v["tier"], v["key_id"], v["cache_salt"], Limits(*v["limits"])),
                max(0.0, time.time() - v["at"]))


class Authenticator:
    """lookup(key) returns the Principal of a live key, or None for an unknown or revoked one;
    answers are reused for ttl seconds (unknown keys for negative_ttl, in a cache of their own).
    While the lookup cannot be made (the control plane is unreachable), a key verified within the
    last stale_seconds is still accepted; any other key is refused with what lookup raised."""

    def __init__(
        self,
        lookup: Callable[[str], Awaitable[Principal | None]],
        ttl_seconds: float,
        negative_ttl_seconds: float = 1.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        stale_seconds: float = 60.0,
        limiter: FailedAuthLimiter | None = None,
        max_unknown: int = edge.FAILED_AUTH_ADDRESSES,
        shared: SharedKeys | None = None,
    ) -> None:
        self._lookup = lookup
        self._shared = shared
        self._sharing: set[asyncio.Task] = set()
        self._share_failing = False
        self._ttl = ttl_seconds
        self._negative_ttl = negative_ttl_seconds
        self._stale = stale_seconds
        self._max = max_entries
        self._max_unknown = max_unknown
        self._clock = clock
        self.limiter = limiter or FailedAuthLimiter(clock=clock)
        # sha256(key) -> (expires, principal, verified at): verified keys only. The caches never
        # hold a key in plain text.
        self._cache: OrderedDict[str, tuple[float, Principal, float]] = OrderedDict()
        # sha256(key) -> until when it is known unknown (or revoked).
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._degraded = False
        self._failed_at = float("-inf")

    async def authenticate(self, authorization: str, client: str = "") -> Principal:
        """The caller's Principal. client: the caller's address, when known (the ingress's check):
        unknown keys from it count against it (FailedAuthLimiter)."""
        key = bearer_key(authorization)
        digest = hashlib.sha256(key.encode()).hexdigest()
        now = self._clock()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        if self._unknown.get(digest, float("-inf")) > now:
            self._refuse(client)
        if hit is None and (wait := self.limiter.retry_after(client)):
            raise ResourceExhausted(
                f"too many unknown API keys from your address ({client}): retry in {wait:.0f} s with a valid key",
                reason="rate_limit_exceeded", retry_after=max(1.0, wait))
        if (self._degraded and hit is not None and now - hit[2] <= self._stale
                and now - self._failed_at < RECHECK_SECONDS):
            # Control just failed to answer: don't make every request wait for it to fail again.
            return hit[1]
        try:
            principal = await self._lookup(key)
        except GaasError as exc:
            self._failed_at = self._clock()
            if hit is None or now - hit[2] > self._stale:
                hit = await self._recall(digest, now)
                if hit is None:
                    raise
            if not self._degraded:
                log.warning("cannot verify API keys (%s); accepting keys verified in the last %.0f s", exc, self._stale)
                self._degraded = True
            return hit[1]
        if self._degraded:
            log.info("API keys are verified again")
            self._degraded = False
        if principal is not None or hit is not None:  # (an unknown key costs Redis nothing)
            self._share(digest, principal)
        if principal is None:
            self._cache.pop(digest, None)  # revoked: not even while control is away
            self._unknown[digest] = now + self._negative_ttl
            self._unknown.move_to_end(digest)
            while len(self._unknown) > self._max_unknown:
                self._unknown.popitem(last=False)
            self._refuse(client)
        self._cache[digest] = (now + self._ttl, principal, now)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return principal

    async def _recall(self, digest: str, now: float) -> tuple[float, Principal, float] | None:
        """The shared cache's entry for a key this router has not verified lately (cached here as
        verified when its peer did), or None."""
        if self._shared is None:
            return None
        try:
            found = await self._shared.recall(digest)
        except Exception as exc:  # noqa: BLE001 - Redis away too: the key cannot be checked
            log.debug("cannot read the routers' verified keys: %s", exc)
            return None
        if found is None or found[1] > self._stale:
            return None
        hit = self._cache[digest] = (now + self._ttl, found[0], now - found[1])
        return hit

    def _share(self, digest: str, principal: Principal | None) -> None:
        """Tell the other routers, in the background, what control said of a key."""
        if self._shared is None:
            return
        task = asyncio.create_task(self._shared.remember(digest, principal) if principal is not None
                                   else self._shared.forget(digest))
        self._sharing.add(task)
        task.add_done_callback(self._shared_done)

    def _shared_done(self, task: asyncio.Task) -> None:
        self._sharing.discard(task)
        if task.cancelled():
            return
        if (exc := task.exception()) is None:
            self._share_failing = False
        elif not self._share_failing:
            # Said once until a share succeeds again: Redis away, or refusing (its ACL, full).
            self._share_failing = True
            log.warning("cannot share verified keys with the other routers (%s: %s); a router restarted while "
                        "control is away refuses the keys it has not verified itself", type(exc).__name__, exc)

    def _refuse(self, client: str):
        self.limiter.failed(client)
        raise Unauthenticated("invalid API key: it is unknown or was revoked")
