"""What a router is doing for each tenant: requests in flight now, and requests and tokens over
the last minute (`gaas top`'s tenant view, through gaas.v1.Router/GetFlowStatus). Tenants with
nothing in flight and nothing in the last minute are forgotten, so memory follows activity."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_SECONDS = 60.0


@dataclass(slots=True)
class _Tenant:
    tier: str
    in_flight: int = 0
    # (finished at, tokens) of the requests that ended within the window.
    done: deque = field(default_factory=deque)


@dataclass(frozen=True, slots=True)
class TenantNow:
    tenant: str
    tier: str
    in_flight: int
    requests: int
    tokens: int


class TenantActivity:
    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float = WINDOW_SECONDS) -> None:
        self._clock = clock
        self._window = window
        self._tenants: dict[str, _Tenant] = {}

    def started(self, tenant: str, tier: str) -> None:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(tier)
        t.tier = tier
        t.in_flight += 1

    def finished(self, tenant: str, tokens: int) -> None:
        t = self._tenants.get(tenant)
        if t is None:
            return
        t.in_flight = max(0, t.in_flight - 1)
        t.done.append((self._clock(), tokens))
        self._trim(t)

    def _trim(self, t: _Tenant) -> None:
        horizon = self._clock() - self._window
        while t.done and t.done[0][0] < horizon:
            t.done.popleft()

    def snapshot(self) -> list[TenantNow]:
        """Every tenant active now or within the window, busiest (tokens) first."""
        out = []
        for name in list(self._tenants):
            t = self._tenants[name]
            self._trim(t)
            if not t.in_flight and not t.done:
                del self._tenants[name]
                continue
            out.append(TenantNow(name, t.tier, t.in_flight, len(t.done), sum(n for _, n in t.done)))
        return sorted(out, key=lambda s: (-s.tokens, -s.in_flight, s.tenant))
