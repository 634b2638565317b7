"""The one percentile every benchmark's figures use."""

from __future__ import annotations

from collections.abc import Iterable

from gaas.runtime.metrics import nearest_rank


def percentile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) of values by the nearest-rank method: a value that occurred, never one
    interpolated between two, as the router computes the p95s and p99s it acts on (gaas.runtime.metrics);
    NaN for no values, so an empty sample never reads as a figure."""
    values = list(values)
    return nearest_rank(values, q) if values else float("nan")
