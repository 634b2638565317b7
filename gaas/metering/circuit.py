"""Whether to ask Redis about a request's admission right now (RedisCircuit): while Redis does not
answer, each request asking it first would pay the failure (a refused connection, or a whole
timeout when it is unreachable) before falling back, so after a failure the circuit opens and the
fallback admits at once; after retry_seconds one request goes through to Redis again (the others
keep to the fallback while it is out), and its answer closes the circuit: the request after Redis
is back is admitted by Redis again, within retry_seconds of its return."""

from __future__ import annotations

import time
from collections.abc import Callable

# How soon after a failure Redis is tried again (by one request).
RETRY_SECONDS = 0.5


class RedisCircuit:
    """Closed (Redis is asked), open after a failure (it is not, for retry_seconds), then half open
    (one request is let through; its success closes the circuit, its failure opens it again)."""

    def __init__(self, retry_seconds: float = RETRY_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self._retry = retry_seconds
        # Monotonic seconds (tests move it).
        self._clock = clock
        # When Redis may be tried again (None: closed, Redis is asked).
        self._retry_at: float | None = None
        # A request let through to try Redis has not come back yet.
        self._trying = False

    @property
    def is_open(self) -> bool:
        """Redis failed and has not answered since (a request trying it is under way, or due)."""
        return self._retry_at is not None

    def allows(self) -> bool:
        """Whether this request asks Redis; when it does, failed(), succeeded() or abandoned()
        must follow."""
        if self._retry_at is None:
            return True
        if self._trying or self._clock() < self._retry_at:
            return False
        self._trying = True
        return True

    def failed(self) -> None:
        self._retry_at = self._clock() + self._retry
        self._trying = False

    def succeeded(self) -> None:
        self._retry_at = None
        self._trying = False

    def abandoned(self) -> None:
        """The request asking Redis ended without an answer either way (cancelled): another may try."""
        self._trying = False
