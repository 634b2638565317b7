"""Quality of service by tier: one definition for the deployment file (`qos:`), the control plane
(which resolves a tenant's quotas: its own, else its tier's) and the router (which orders, limits
and sheds by it).

Priority bands: a tier sets the band a request is served in, end to end (the router's queue and
vLLM's priority scheduling). Within its band a client may ask for high, normal or low priority;
it can never rise above its tier: a bronze request asking for high priority is still served after
every silver and gold one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from gaas.contracts.tenancy import DEFAULT_TIER, TIERS, TIERS_BY_PRIORITY
from gaas.v1 import common_pb2

# The band of batch items (gaas.contracts.batches), below every tier's: served with what interactive
# requests leave idle, and the first shed.
BATCH = "batch"
# Lower bands are served first.
BAND_NAMES = (*TIERS_BY_PRIORITY, BATCH)
BANDS = {tier: band for band, tier in enumerate(BAND_NAMES)}
# A client's priority within its band: vLLM serves lower values first.
_WITHIN_BAND = {
    common_pb2.PRIORITY_HIGH: 0,
    common_pb2.PRIORITY_NORMAL: 1,
    common_pb2.PRIORITY_UNSPECIFIED: 1,
    common_pb2.PRIORITY_LOW: 2,
}
PER_BAND = 3


def band(tier: str) -> int:
    """The band of a tier (or of BATCH)."""
    return BANDS.get(tier, BANDS[DEFAULT_TIER])


def engine_priority(tier: str, client_priority: int) -> int:
    """vLLM's priority for a request of this tier (or BATCH) asking for client_priority (lower is
    served first)."""
    return band(tier) * PER_BAND + _WITHIN_BAND.get(client_priority, 1)


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's quotas; 0 means unlimited."""

    # Requests per minute, tokens per minute (prompt + completion), requests at once.
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0


@dataclass(frozen=True, slots=True)
class TierPolicy:
    # Quotas of the tier's tenants, unless a tenant has its own.
    limits: Limits = Limits()
    # The time to first token the tier is promised (the batching window shrinks when a worker's
    # p95 passes it), and how long a request may wait in a router's queue for a worker.
    ttft_target_ms: float = 1000.0
    queue_timeout_s: float = 30.0


DEFAULT_POLICIES: dict[str, TierPolicy] = {
    "gold": TierPolicy(Limits(), ttft_target_ms=500, queue_timeout_s=30),
    "silver": TierPolicy(Limits(rpm=3000, tpm=2_000_000, concurrency=64), ttft_target_ms=1500, queue_timeout_s=20),
    "bronze": TierPolicy(Limits(rpm=600, tpm=500_000, concurrency=16), ttft_target_ms=5000, queue_timeout_s=10),
}

_LIMIT_KEYS = ("rpm", "tpm", "concurrency")
_POLICY_KEYS = (*_LIMIT_KEYS, "ttft_target_ms", "queue_timeout_s")


def parse_policies(doc: object, where: str = "qos") -> dict[str, TierPolicy]:
    """{tier: {rpm, tpm, concurrency, ttft_target_ms, queue_timeout_s}} over the defaults;
    ValueError naming the entry."""
    if doc is None:
        return dict(DEFAULT_POLICIES)
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where} must map tiers ({', '.join(TIERS)}) to their quotas and targets")
    out = dict(DEFAULT_POLICIES)
    for tier, entry in doc.items():
        if tier not in TIERS:
            raise ValueError(f"{where}: unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
        if not isinstance(entry, Mapping) or set(entry) - set(_POLICY_KEYS):
            raise ValueError(f"{where}.{tier} takes {', '.join(_POLICY_KEYS)}")
        values = {}
        for key, value in entry.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{where}.{tier}.{key} must be a number >= 0 (0: unlimited), got {value!r}")
            if key in _LIMIT_KEYS and value != int(value):
                raise ValueError(f"{where}.{tier}.{key} must be a whole number, got {value!r}")
            values[key] = value
        if values.get("ttft_target_ms", 1) <= 0 or values.get("queue_timeout_s", 1) <= 0:
            raise ValueError(f"{where}.{tier}: ttft_target_ms and queue_timeout_s must be above 0")
        base = out[tier]
        limits = replace(base.limits, **{k: int(v) for k, v in values.items() if k in _LIMIT_KEYS})
        out[tier] = replace(base, limits=limits, **{k: float(v) for k, v in values.items() if k not in _LIMIT_KEYS})
    return out
