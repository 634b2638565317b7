"""What the dimensions share: percentiles of outcomes, and reading a histogram's change out of the
routers' metrics between two moments."""

from __future__ import annotations

from bench.common.stats import parts_p50_p95, percentile
from bench.sits.load import Outcome


def ttft_summary(outcomes: list[Outcome]) -> dict:
    """TTFT p50 / p95 (ms) of the served ones, how many were served and failed; and, where the mesh
    said where their time went, each part's p50 / p95."""
    ok = [o.ttft_ms for o in outcomes if o.ok and o.ttft_ms]
    out = {"requests": len(outcomes), "served": len(ok), "failed": sum(1 for o in outcomes if not o.ok),
           "ttft_p50_ms": round(percentile(ok, 0.5), 1), "ttft_p95_ms": round(percentile(ok, 0.95), 1)}
    parts = parts_p50_p95(o.parts for o in outcomes if o.ok)
    if parts:
        out["latency_ms"] = parts
    return out


def histogram_delta(before: dict, after: dict, name: str, label: str | None = None) -> dict[str, tuple[float, float]]:
    """(sum, count) that histogram `name` gained between two router_metrics() readings, by the value
    of `label` ("" when not split by one)."""
    def read(m: dict) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for suffix, i in (("_sum", 0), ("_count", 1)):
            for labels, value in m.get(name + suffix, ()):
                key = labels.get(label, "") if label else ""
                out.setdefault(key, [0.0, 0.0])[i] += value
        return out

    a, b = read(before), read(after)
    return {k: (v[0] - a.get(k, [0.0, 0.0])[0], v[1] - a.get(k, [0.0, 0.0])[1]) for k, v in b.items()}


def histogram_quantile(before: dict, after: dict, name: str, q: float) -> float | None:
    """The upper bound (seconds) of the bucket holding the q-quantile of what histogram `name`
    gained between two router_metrics() readings (inf: past the last bucket; None: no samples)."""
    def buckets(m: dict) -> dict[float, float]:
        out: dict[float, float] = {}
        for labels, value in m.get(name + "_bucket", ()):
            le = float(labels.get("le", "inf"))
            out[le] = out.get(le, 0.0) + value
        return out

    a, b = buckets(before), buckets(after)
    gained = sorted((le, n - a.get(le, 0.0)) for le, n in b.items())
    total = gained[-1][1] if gained else 0.0
    if total <= 0:
        return None
    return next(le for le, n in gained if n >= q * total)
