"""The one percentile every benchmark's figures use, and the latency parts' p50 / p95 of requests that
said where their time went."""

from __future__ import annotations

from collections.abc import Iterable

from gaas.runtime.metrics import nearest_rank


def percentile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) of values by the nearest-rank method: a value that occurred, never one
    interpolated between two, as the router computes the p95s and p99s it acts on (gaas.runtime.metrics);
    NaN for no values, so an empty sample never reads as a figure."""
    values = list(values)
    return nearest_rank(values, q) if values else float("nan")


def parts_p50_p95(reported: Iterable[dict]) -> dict:
    """Each latency part's p50 / p95 (ms) over the requests' reports (gaas.contracts.latency's parts,
    as x-gaas-explain returns them); {} when none reported."""
    reported = [r for r in reported if r]
    if not reported:
        return {}
    return {part: {"p50": round(percentile([r.get(part, 0.0) for r in reported], 0.5), 2),
                   "p95": round(percentile([r.get(part, 0.0) for r in reported], 0.95), 2)} for part in reported[0]}
