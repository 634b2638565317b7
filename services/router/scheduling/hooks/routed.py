"""Post-cycle: each placement counted by policy and worker (gaas_router_routed_total)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter

from services.router.scheduling.types import Candidate, PostCycle, RequestContext


class Routed(PostCycle):
    name = "routed"

    def __init__(self, counter: Counter, policy: str) -> None:
        self._counter = counter
        self._policy = policy

    def picked(self, ctx: RequestContext, worker: Candidate, candidates: Sequence[Candidate]) -> None:
        self._counter.labels(self._policy, worker.worker_id).inc()
