"""Who is calling: the API key from the Authorization header, looked up in the control plane and
cached briefly (a revoked key stops working within the cache's TTL, a few seconds)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from gaas.errors import GaasError, Unauthenticated
from gaas.principal import Principal

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


class Authenticator:
    """lookup(key) returns the Principal of a live key, or None for an unknown or revoked one;
    answers are reused for ttl seconds (misses for negative_ttl). While the lookup cannot be made
    (the control plane is unreachable), a key verified within the last stale_seconds is still
    accepted; any other key is refused with what lookup raised."""

    def __init__(
        self,
        lookup: Callable[[str], Awaitable[Principal | None]],
        ttl_seconds: float,
        negative_ttl_seconds: float = 1.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        stale_seconds: float = 60.0,
    ) -> None:
        self._lookup = lookup
        self._ttl = ttl_seconds
        self._negative_ttl = negative_ttl_seconds
        self._stale = stale_seconds
        self._max = max_entries
        self._clock = clock
        # sha256(key) -> (expires, principal or None, verified at): the cache never holds a key in plain text.
        self._cache: OrderedDict[str, tuple[float, Principal | None, float]] = OrderedDict()
        self._degraded = False
        self._failed_at = float("-inf")

    async def authenticate(self, authorization: str) -> Principal:
        key = bearer_key(authorization)
        digest = hashlib.sha256(key.encode()).hexdigest()
        now = self._clock()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            principal = hit[1]
        elif (self._degraded and hit is not None and hit[1] is not None and now - hit[2] <= self._stale
              and now - self._failed_at < RECHECK_SECONDS):
            # Control just failed to answer: don't make every request wait for it to fail again.
            return hit[1]
        else:
            try:
                principal = await self._lookup(key)
            except GaasError as exc:
                self._failed_at = self._clock()
                if hit is None or hit[1] is None or now - hit[2] > self._stale:
                    raise
                if not self._degraded:
                    log.warning("cannot verify API keys (%s); accepting keys verified in the last %.0f s", exc,
                                self._stale)
                    self._degraded = True
                return hit[1]
            if self._degraded:
                log.info("API keys are verified again")
                self._degraded = False
            self._cache[digest] = (now + (self._ttl if principal else self._negative_ttl), principal, now)
            self._cache.move_to_end(digest)
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        if principal is None:
            raise Unauthenticated("invalid API key: it is unknown or was revoked")
        return principal
