"""A pool's autoscaler, as control runs it (gaas.contracts.autoscale says what the deployment
declares): each look it is told the pool's signals and says how many workers the pool should have,
and why. Pure: time and signals come in as arguments, so it is tested with a fake clock.

  up     the pool's requests (running and waiting) per serving worker past the target, its
         KV-cache use past the target, or a tier's TTFT p95 past its target: one worker more once
         the signal has held up_after_s (a request waiting for a pool at zero: one at once);
  down   the requests would fit in one worker fewer at half the target, the KV-cache use is under
         half its target and no tier is past its TTFT target, for down_after_s: one worker fewer
         (it drains first: gaas up retires it);
  zero   with min 0, nothing running, waiting or asked for, for zero_after_s: no worker.
No change while a worker it asked for is still starting (and the windows count from when it serves),
nor within cooldown_s of the last (but a request waiting for a pool at zero)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gaas.contracts.autoscale import AutoscalePolicy


@dataclass(frozen=True, slots=True)
class Signals:
    """A pool's state, as the registry's load reports and the routers' outcomes give it."""

    # Serving workers, and workers asked for that are not serving yet.
    ready: int = 0
    starting: int = 0
    # Requests running and waiting in the ready workers' engines.
    running: int = 0
    waiting: int = 0
    # Mean KV-cache use of the ready workers (0..1).
    kv_usage: float = 0.0
    # A tier past its TTFT p95 target, said as a reason ("" none).
    ttft_breach: str = ""
    # A request waits at a router for a worker of this pool's model (none serves).
    demand: bool = False


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    at: float
    replicas: int
    reason: str

    def as_dict(self) -> dict:
        return {"at": self.at, "replicas": self.replicas, "reason": self.reason}


class PoolScaler:
    def __init__(self, policy: AutoscalePolicy, replicas: int, now: float) -> None:
        self.policy = policy
        self.replicas = max(policy.min, min(policy.max, replicas))
        self.changed_at = now
        # When the signals began asking for more, for fewer, and when the pool went idle (None: not now).
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._idle_since: float | None = None

    def look(self, now: float, s: Signals) -> ScaleDecision | None:
        p = self.policy
        if self.replicas == 0:
            if s.demand and p.max >= 1:
                return self._go(now, 1, "a request waits for a worker of a pool at zero")
            return None
        if s.starting:
            # A worker asked for is not serving yet: nothing is judged until it is (its start would
            # count as idle time, or as load the new worker is there to take).
            self._up_since = self._down_since = self._idle_since = None
            return None
        outstanding = s.running + s.waiting
        self._idle_since = (self._idle_since or now) if outstanding == 0 and not s.demand else None
        per_worker = outstanding / max(s.ready, 1)
        up = (f"{per_worker:.1f} requests per serving worker, over the target {p.target_requests:g}"
              if per_worker > p.target_requests else
              f"KV-cache use {s.kv_usage:.0%}, over the target {p.target_kv_usage:.0%}" if s.kv_usage > p.target_kv_usage
              else s.ttft_breach)
        fits_fewer = self.replicas > 1 and outstanding <= p.target_requests * (self.replicas - 1) / 2
        down = (fits_fewer and s.kv_usage <= p.target_kv_usage / 2 and not s.ttft_breach and not s.demand
                and s.ready >= self.replicas)
        self._up_since = (self._up_since or now) if up else None
        self._down_since = (self._down_since or now) if down else None
        if now - self.changed_at < p.cooldown_s:
            return None
        if up and self.replicas < p.max and now - self._up_since >= p.up_after_s:
            return self._go(now, self.replicas + 1, up)
        if p.min == 0 and self._idle_since is not None and now - self._idle_since >= p.zero_after_s:
            return self._go(now, 0, f"idle for {now - self._idle_since:.0f} s")
        if down and self.replicas > max(p.min, 1) and now - self._down_since >= p.down_after_s:
            return self._go(now, self.replicas - 1, f"{outstanding} requests fit in {self.replicas - 1} worker(s) "
                                                    f"at half the target for {now - self._down_since:.0f} s")
        return None

    def _go(self, now: float, replicas: int, reason: str) -> ScaleDecision:
        self.replicas = replicas
        self.changed_at = now
        self._up_since = self._down_since = self._idle_since = None
        return ScaleDecision(now, replicas, f"{replicas} worker(s): {reason}")

    def wanted(self, outstanding: int) -> int:
        """How many workers outstanding requests would fill to the target (for what is reported)."""
        return max(self.policy.min, min(self.policy.max, math.ceil(outstanding / self.policy.target_requests)))
