"""What the guard judges a version by: each finished request's outcome, kept over a sliding
window, summed per version into its figures (TTFT p95 per tier, error rate, tokens per second)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gaas.contracts.rollout import Outcome
from gaas.runtime.metrics import nearest_rank

__all__ = ["Figures", "Outcome", "Window", "p95"]


def p95(values: Iterable[float]) -> float:
    """The nearest-rank 95th percentile (0 for none), as every figure of the mesh's is taken."""
    return nearest_rank(values, 0.95)


@dataclass(frozen=True, slots=True)
class Figures:
    """A version's requests over the window."""

    requests: int = 0
    errors: int = 0
    # tier -> (TTFT p95 ms, requests with a first token)
    ttft_p95: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    # Output tokens per second of decoding, over the requests that decoded (0: none did).
    tokens_per_s: float = 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "errors": self.errors, "error_rate": round(self.error_rate, 4),
                "ttft_p95_ms": {t: {"p95": round(v, 1), "n": n} for t, (v, n) in sorted(self.ttft_p95.items())},
                "tokens_per_s": round(self.tokens_per_s, 1)}


class Window:
    """The outcomes of the last window_s seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._outcomes: deque[Outcome] = deque()

    def add(self, outcome: Outcome) -> None:
        self._outcomes.append(outcome)

    def _trim(self, now: float) -> None:
        while self._outcomes and self._outcomes[0].at < now - self.window_s:
            self._outcomes.popleft()

    def figures(self, now: float, version: str, since: float = -math.inf) -> Figures:
        """version's figures over the window, counting only outcomes from since on (a step's start)."""
        self._trim(now)
        mine = [o for o in self._outcomes if o.version == version and o.at >= since]
        ttfts: dict[str, list[float]] = {}
        tokens, decode_s = 0, 0.0
        for o in mine:
            if o.ttft_ms is not None:
                ttfts.setdefault(o.tier, []).append(o.ttft_ms)
            if o.ok and o.output_tokens > 1 and o.decode_s > 0:
                tokens += o.output_tokens - 1
                decode_s += o.decode_s
        return Figures(
            requests=len(mine),
            errors=sum(1 for o in mine if not o.ok),
            ttft_p95={tier: (p95(v), len(v)) for tier, v in ttfts.items()},
            tokens_per_s=tokens / decode_s if decode_s else 0.0,
        )
