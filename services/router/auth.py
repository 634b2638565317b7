"""Who is calling: the API key from the Authorization header, looked up in the control plane and
cached briefly (a revoked key stops working within the cache's TTL, a few seconds).

Verified keys and unknown ones are cached apart: a flood of made-up keys fills only the cache of
unknown ones, never evicting the verified keys that keep tenants served while control is away.
And a client address that keeps sending unknown keys is slowed (FailedAuthLimiter): past a burst,
its keys are no longer looked up at all (429, with when to retry), unless they were verified
before."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from gaas.contracts import edge
from gaas.contracts.errors import GaasError, ResourceExhausted, Unauthenticated
from gaas.contracts.principal import Principal

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
    ) -> None:
        self._lookup = lookup
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
                raise
            if not self._degraded:
                log.warning("cannot verify API keys (%s); accepting keys verified in the last %.0f s", exc, self._stale)
                self._degraded = True
            return hit[1]
        if self._degraded:
            log.info("API keys are verified again")
            self._degraded = False
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

    def _refuse(self, client: str):
        self.limiter.failed(client)
        raise Unauthenticated("invalid API key: it is unknown or was revoked")
