"""The autoscalers of the deployment's autoscaled pools, as the control replica that drives
roll-outs runs them (services/control/rollout/driver.py calls look() once a second while it leads).

Each look, per autoscaled pool (a model version whose `autoscale:` the deployment declares): its
signals from the registry (serving workers and their load reports: requests running and waiting,
KV-cache use), the routers' outcomes (TTFT p95 per tier over the last SIGNAL_WINDOW_S against the
tier's target) and Redis (a request waiting at a router for a model none of whose workers serves:
gaas.contracts.autoscale.DEMAND_KEY), given to the pool's PoolScaler (services/control/autoscale.py,
pure); a decision is saved (services/control/deployment.py: ListPools tells launchers the new
count) with its reason. A new leader starts each pool's scaler from the count last saved."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from gaas.contracts.autoscale import DEMAND_KEY, AutoscalePolicy
from services.control.autoscale import PoolScaler, ScaleDecision, Signals
from services.control.deployment import Deployment, Pool
from services.control.registry import SERVING, WorkerRegistry
from services.control.rollout.figures import Window

log = logging.getLogger(__name__)

# The outcomes an autoscaled model's TTFT is judged on, s, and the fewest of a tier's requests that judge.
SIGNAL_WINDOW_S = 30.0
MIN_TTFT_SAMPLES = 20


class Autoscalers:
    def __init__(self, deployment: Deployment, registry: WorkerRegistry, redis,
                 replicas_gauge=None, decisions_counter=None) -> None:
        """replicas_gauge: (model, version) the workers each autoscaled pool is to have;
        decisions_counter: (model, direction) the decisions made (Prometheus, when the server gives them)."""
        self._deployment = deployment
        self._registry = registry
        self._redis = redis
        self._replicas = replicas_gauge
        self._decisions = decisions_counter
        self._scalers: dict[tuple[str, str], PoolScaler] = {}

    def forget(self) -> None:
        """Another replica leads: its scalers start from what it reads."""
        self._scalers.clear()

    async def look(self, pools: list[Pool], now: float, windows: Mapping[str, Window],
                   target_ms: Callable[[str], float]) -> list[tuple[Pool, ScaleDecision]]:
        """One look at every autoscaled pool (pools: the deployment's autoscaled pools as of this
        look); the decisions made (each saved)."""
        keys = {(p.model, p.version) for p in pools}
        for key in [k for k in self._scalers if k not in keys]:
            del self._scalers[key]
        made = []
        for pool in pools:
            policy: AutoscalePolicy = pool.autoscale
            key = (pool.model, pool.version)
            scaler = self._scalers.get(key)
            if scaler is None or scaler.policy != policy:
                scaler = self._scalers[key] = PoolScaler(policy, int(pool.spec["replicas"]), now)
            signals = await self.signals(pool, scaler, now, windows.get(pool.model), target_ms)
            decision = scaler.look(now, signals)
            if self._replicas is not None:
                self._replicas.labels(pool.model, pool.version).set(scaler.replicas)
            if decision is None:
                continue
            log.info("%s %s: %s", pool.model, pool.version, decision.reason)
            await self._deployment.scaled(pool.model, pool.version, decision.replicas, decision.reason)
            if self._decisions is not None:
                before = int(pool.spec["replicas"])
                direction = "up" if decision.replicas > before else "zero" if decision.replicas == 0 else "down"
                self._decisions.labels(pool.model, direction).inc()
            made.append((pool, decision))
        return made

    async def signals(self, pool: Pool, scaler: PoolScaler, now: float, window: Window | None,
                      target_ms: Callable[[str], float]) -> Signals:
        workers = [w for w in await self._registry.list(pool.model) if w.model_version == pool.version]
        ready = [w for w in workers if w.state == SERVING]
        breach = ""
        if window is not None:
            for tier, (p95, n) in sorted(window.figures(now, pool.version).ttft_p95.items()):
                target = target_ms(tier)
                if n >= MIN_TTFT_SAMPLES and target and p95 > target:
                    breach = f"{tier} TTFT p95 {p95:.0f} ms over {n} requests, past its {target:.0f} ms target"
                    break
        demand = bool(await self._redis.exists(DEMAND_KEY.format(pool.model))) if not ready else False
        return Signals(
            ready=len(ready),
            starting=max(0, scaler.replicas - len(ready)),
            running=sum(int(w.load.get("running_requests", 0)) for w in ready),
            waiting=sum(int(w.load.get("waiting_requests", 0)) for w in ready),
            kv_usage=sum(float(w.load.get("kv_cache_usage", 0.0)) for w in ready) / len(ready) if ready else 0.0,
            ttft_breach=breach,
            demand=demand,
        )
