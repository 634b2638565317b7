"""Circuit breaking per worker, in the router: a worker that fails in bursts, or answers slower
than its own recent p99 allows, is taken out of scheduling for a while, then tried with one
request (half-open) before it is trusted again. Envoy's outlier detection on the sidecars'
clusters is the second line.

Closed -> open: a connection-level failure (the worker is not there), or at least 5 failures in a
row making up at least 60% of its last 30 s (SITS2026's resilience dimension). A request whose
first token takes longer than the worker's threshold counts as a failure: 1.3 x its own p99 TTFT
over the last minute, never below 800 ms nor above 12 s (12 s until it has 20 samples), for a
request of its prompt's length: TTFTs are kept per unit of work (1 + the prompt's tokens not
expected from the prefix cache / WORK_TOKENS), and the threshold (its bounds too) is scaled by the
request's own, so a burst of long prompts is slow without being a failure.
Open -> half-open after a cooldown (5 s, doubling up to 60 s while probes fail); the probe's
success closes it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gaas.runtime.metrics import nearest_rank
from gaas.contracts.ids import WorkerId

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
# Prompt tokens to compute that make one more unit of a first token's work.
WORK_TOKENS = 1024


def prompt_work(uncached_tokens: int) -> float:
    """A first token's work, in units: 1, and one more per WORK_TOKENS prompt tokens to compute."""
    return 1.0 + max(0, uncached_tokens) / WORK_TOKENS


@dataclass(slots=True)
class Breaker:
    state: str = CLOSED
    consecutive: int = 0
    results: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, ok)
    ttfts: deque = field(default_factory=lambda: deque(maxlen=512))  # (time, ms per unit of work)
    opened_at: float = 0.0
    cooldown: float = 0.0
    probing: bool = False
    trips: int = 0


class Breakers:
    def __init__(
        self, *, trip_consecutive: int = 5, trip_ratio: float = 0.6, window_seconds: float = 30.0,
        cooldown_seconds: float = 5.0, max_cooldown_seconds: float = 60.0, min_threshold_ms: float = 800.0,
        max_threshold_ms: float = 12_000.0, clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[WorkerId, str, str], None] = lambda worker, state, why: None,
    ) -> None:
        self._trip_consecutive = trip_consecutive
        self._trip_ratio = trip_ratio
        self._window = window_seconds
        self._cooldown = cooldown_seconds
        self._max_cooldown = max_cooldown_seconds
        self._min_ms, self._max_ms = min_threshold_ms, max_threshold_ms
        self._clock = clock
        self._on_change = on_change
        self._breakers: dict[WorkerId, Breaker] = {}

    def _get(self, worker: WorkerId) -> Breaker:
        return self._breakers.setdefault(worker, Breaker())

    def blocked(self) -> frozenset[WorkerId]:
        """Workers not to schedule now: open and cooling down, or half-open with their probe out."""
        now = self._clock()
        return frozenset(
            w for w, b in self._breakers.items()
            if (b.state == OPEN and now < b.opened_at + b.cooldown) or (b.state == HALF_OPEN and b.probing)
        )

    def started(self, worker: WorkerId) -> None:
        """A request goes to worker: an open breaker past its cooldown lets it through as the probe."""
        b = self._get(worker)
        if b.state == OPEN and self._clock() >= b.opened_at + b.cooldown:
            b.state, b.probing = HALF_OPEN, True
            self._on_change(worker, HALF_OPEN, "cooldown over: one probe request")
        elif b.state == HALF_OPEN:
            b.probing = True

    def threshold_ms(self, worker: WorkerId, work: float = 1.0) -> float:
        """How long a first token of `work` units (prompt_work) may take on worker before the
        request counts as failed."""
        b = self._get(worker)
        since = self._clock() - 60.0
        values = [ms for t, ms in b.ttfts if t >= since]
        if len(values) < 20:
            return self._max_ms * work
        p99 = nearest_rank(values, 0.99)
        return work * min(self._max_ms, max(self._min_ms, 1.3 * p99))

    def success(self, worker: WorkerId, ttft_ms: float | None = None, work: float = 1.0) -> None:
        """worker answered (first token after ttft_ms, when known, for `work` units)."""
        b = self._get(worker)
        now = self._clock()
        if ttft_ms is not None:
            b.ttfts.append((now, ttft_ms / max(1.0, work)))
        b.results.append((now, True))
        b.consecutive = 0
        if b.state == HALF_OPEN:
            b.state, b.probing, b.cooldown = CLOSED, False, 0.0
            self._on_change(worker, CLOSED, "probe succeeded")

    def failure(self, worker: WorkerId, why: str, immediate: bool = False) -> None:
        """worker failed a request (immediate: it cannot even be reached)."""
        b = self._get(worker)
        now = self._clock()
        b.results.append((now, False))
        b.consecutive += 1
        if b.state == HALF_OPEN:
            self._open(worker, b, min(self._max_cooldown, max(self._cooldown, b.cooldown * 2)), f"probe failed: {why}")
            return
        if b.state == OPEN:
            return
        recent = [ok for t, ok in b.results if t >= now - self._window]
        ratio = recent.count(False) / len(recent)
        if immediate or (b.consecutive >= self._trip_consecutive and ratio >= self._trip_ratio):
            self._open(worker, b, self._cooldown, why)

    def _open(self, worker: WorkerId, b: Breaker, cooldown: float, why: str) -> None:
        b.state, b.probing, b.opened_at, b.cooldown = OPEN, False, self._clock(), cooldown
        b.trips += 1
        self._on_change(worker, OPEN, f"{why}; cooling down {cooldown:.0f} s")

    def ended(self, worker: WorkerId) -> None:
        """A request to worker ended. A probe that ended without a verdict (its client went away)
        lets the next request probe instead of blocking the worker for good."""
        b = self._breakers.get(worker)
        if b is not None and b.state == HALF_OPEN and b.probing:
            b.probing = False

    def forget(self, keep: Iterable[WorkerId]) -> None:
        """Drop the breakers of workers that left the registry (one that comes back starts afresh)."""
        keep = set(keep)
        for worker in [w for w in self._breakers if w not in keep]:
            del self._breakers[worker]

    def state(self) -> dict[WorkerId, Breaker]:
        return dict(self._breakers)
