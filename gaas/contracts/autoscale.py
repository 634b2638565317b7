"""A pool's autoscaling, as the deployment declares it (a model's `autoscale:` in deploy/gaas.yaml)
and control's autoscaler applies it (services/control/autoscale.py): between min and max workers,
on the mesh's own signals (requests in each worker's engine, KV-cache use, TTFT p95 against the
tiers' targets), with a stabilization window each way and a cool-down after each change; an idle
pool with min 0 goes to zero workers, and a request for it brings one back. initial_scale is the
count a pool starts with (Knative's initial-scale): 0 starts a pool at zero, its first request
bringing up its first worker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    min: int = 1
    max: int = 1
    # Requests (running and waiting) each worker should hold; more on average asks for a worker more.
    target_requests: float = 8.0
    # KV-cache use past which a pool asks for a worker more (0..1).
    target_kv_usage: float = 0.85
    # How long the signals must ask for more (up) or fewer (down) workers before the count moves, s.
    up_after_s: float = 5.0
    down_after_s: float = 60.0
    # After a change, how long before the next, s (a new worker's load report settles).
    cooldown_s: float = 30.0
    # min 0: a pool idle (no request running, waiting or asked for) this long goes to zero, s.
    zero_after_s: float = 300.0
    # Workers the pool starts with; None: min, at least one.
    initial_scale: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max:
            raise ValueError(f"autoscale needs 0 <= min <= max, not min {self.min}, max {self.max}")
        if self.max < 1:
            raise ValueError("autoscale.max must be at least 1")
        if self.target_requests <= 0:
            raise ValueError("autoscale.target_requests must be above 0")
        if not 0 < self.target_kv_usage <= 1:
            raise ValueError("autoscale.target_kv_usage must be in (0, 1]")
        for what, v in (("up_after_seconds", self.up_after_s), ("down_after_seconds", self.down_after_s),
                        ("cooldown_seconds", self.cooldown_s), ("zero_after_seconds", self.zero_after_s)):
            if v < 0:
                raise ValueError(f"autoscale.{what} must be 0 or more")
        if self.initial_scale is not None and not self.min <= self.initial_scale <= self.max:
            raise ValueError(f"autoscale.initial_scale must be between min and max ({self.min} to {self.max}), "
                             f"not {self.initial_scale}")

    @property
    def initial(self) -> int:
        """Workers a pool starts with, before its autoscaler's first decision: initial_scale where
        given, else min, at least one (a mesh that starts serves at once; an idle pool with min 0
        goes to zero after zero_after_s)."""
        return max(self.min, 1) if self.initial_scale is None else self.initial_scale

    def as_dict(self) -> dict:
        return {"min": self.min, "max": self.max, "target_requests": self.target_requests,
                "target_kv_usage": self.target_kv_usage, "up_after_s": self.up_after_s,
                "down_after_s": self.down_after_s, "cooldown_s": self.cooldown_s, "zero_after_s": self.zero_after_s,
                **({"initial_scale": self.initial_scale} if self.initial_scale is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> AutoscalePolicy:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# Where a router marks that a model's request waits for a worker no pool of it has (a Redis key per
# model, with a TTL): control's autoscaler brings a scaled-to-zero pool back for it.
DEMAND_KEY = "gaas:autoscale:demand:{}"
DEMAND_TTL_MS = 10_000
# The routers' gauge of the requests each holds for such a model (label model): what brings a pool
# back from zero where Kubernetes' KEDA scales the pools (gaas/k8s/manifests.py).
AWAITING_METRIC = "gaas_router_requests_awaiting_workers"
