"""A request for an autoscaled model that no worker serves (its pools at zero, or every worker
gone) waits at the router while control's autoscaler starts one: what tells the autoscaler is a
key in Redis per model (gaas.contracts.autoscale.DEMAND_KEY, with a TTL), set while such requests
wait, at most once a second per model. Redis away: the waiting request times out as it would have.
How many requests wait for each model is a gauge (gaas.contracts.autoscale.AWAITING_METRIC), what
KEDA wakes a pool at zero on where Kubernetes scales the pools."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from gaas.contracts.autoscale import DEMAND_KEY, DEMAND_TTL_MS

log = logging.getLogger(__name__)

# Seconds between two marks of the same model.
MARK_EVERY_S = 1.0


class Demand:
    def __init__(self, redis, clock=time.monotonic, awaiting=None) -> None:
        """awaiting: a Prometheus gauge labelled by model (None: not counted)."""
        self._redis = redis
        self._clock = clock
        self._awaiting = awaiting
        self._marked: dict[str, float] = {}
        self._failing = False

    async def mark(self, model: str) -> None:
        now = self._clock()
        if now - self._marked.get(model, -MARK_EVERY_S) < MARK_EVERY_S:
            return
        self._marked[model] = now
        try:
            await self._redis.set(DEMAND_KEY.format(model), "1", px=DEMAND_TTL_MS)
            self._failing = False
        except Exception as exc:  # noqa: BLE001 - Redis away: the request waits out its queue timeout
            if not self._failing:
                log.warning("cannot tell the autoscaler that %s has requests waiting (%s)", model, exc)
            self._failing = True

    @contextmanager
    def awaiting(self, model: str):
        """Counts a request as waiting for model's first worker while the block runs."""
        if self._awaiting is None:
            yield
            return
        gauge = self._awaiting.labels(model)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()
