"""What drives the roll-outs: once a second, one control replica (the leader, by a Redis key with a
TTL: no two drive the same roll-out) reads the outcomes routers reported (a Redis stream: requests of
models under a roll-out, by version and tier) into each model's sliding window, and ticks each live
roll-out with whether its new version's workers are ready, why they failed if a report says so,
and the window (services/control/deployment.py's step saves what it decides).

A replica that becomes the leader reads the last window's worth of the stream first, so the guard
judges on the same figures whoever drives. The same leader runs the autoscaled pools' autoscalers
(services/control/scaling.py) after the roll-outs, on the same outcomes (routers report those of
autoscaled models too)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from gaas.contracts.rollout import LEADER_KEY, OUTCOMES_STREAM, Outcome, Strategy
from services.control.deployment import Deployment, View
from services.control.registry import SERVING, WorkerRegistry
from services.control.rollout.figures import Window
from services.control.rollout.machine import Rollout
from services.control.scaling import SIGNAL_WINDOW_S

log = logging.getLogger(__name__)

# How often roll-outs are looked at, and how long a leader's claim lasts unless renewed.
PERIOD_SECONDS = 1.0
LEADER_TTL_MS = 3000
# Stream entries read per look (each a batch of outcomes from one router).
READ_COUNT = 5000

# Takes the leadership when nobody holds it, renews it when this replica does.
_LEAD = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


class Driver:
    def __init__(self, deployment: Deployment, registry: WorkerRegistry, redis, instance: str,
                 clock: Callable[[], float] = time.time, period: float = PERIOD_SECONDS,
                 weights=None, decisions=None, autoscalers=None) -> None:
        """weights: a gauge (model, version) of each live roll-out's share, percent; decisions: a
        counter (model, state) of the decisions made (Prometheus, when the server gives them);
        autoscalers: services.control.scaling.Autoscalers, looked at after the roll-outs."""
        self._autoscalers = autoscalers
        self._weights = weights
        self._decisions = decisions
        self._deployment = deployment
        self._registry = registry
        self._redis = redis
        self._instance = instance
        self._clock = clock
        self._period = period
        self._lead = redis.register_script(_LEAD)
        self._leading = False
        # Model -> the outcomes of its requests over its guard's window.
        self._windows: dict[str, Window] = {}
        self._last_id = ""
        self._wake = asyncio.Event()
        # The (model, version) label sets the weights gauge shows.
        self._shown: set[tuple[str, str]] = set()

    def window(self, model: str) -> Window | None:
        return self._windows.get(model)

    def poke(self) -> None:
        """Look again now (a roll-out was changed)."""
        self._wake.set()

    async def run(self) -> None:
        """Until cancelled (control's server owns it)."""
        while True:
            try:
                await self.once()
            except Exception:  # Redis or the database away: the next look tries again
                log.warning("the roll-out driver's look failed; trying again", exc_info=True)
            try:
                await asyncio.wait_for(self._wake.wait(), self._period)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def once(self) -> None:
        leading = bool(await self._lead(keys=[LEADER_KEY], args=[self._instance, LEADER_TTL_MS]))
        if leading != self._leading:
            log.info("%s roll-outs", "driving" if leading else "no longer driving")
            self._leading = leading
            self._last_id = ""
            if self._autoscalers is not None:
                self._autoscalers.forget()
        if not leading:
            return
        view = await self._deployment.view()
        live = {m: r for m, r in view.live.items() if not r.state.ended}
        # The models whose outcomes are kept, each over the longer of its guard's window and the
        # autoscaler's.
        spans = {m: r.policy.guard.window_s for m, r in live.items()}
        scaled = ([p for p in await self._deployment.pools(view) if p.autoscale is not None]
                  if self._autoscalers is not None else [])
        for p in scaled:
            spans[p.model] = max(spans.get(p.model, 0.0), SIGNAL_WINDOW_S)
        for model, span in spans.items():
            w = self._windows.get(model)
            if w is None or w.window_s != span:
                self._windows[model] = Window(span)
        for model in list(self._windows):
            if model not in spans:
                del self._windows[model]
        await self._read_outcomes(max(spans.values(), default=60.0))
        for model, r in live.items():
            ready = await self._ready(view, r)
            failures = await self._deployment.failures(model, r.version, int(r.started_at * 1000))
            now, window, failed = self._clock(), self._windows[model], failures[-1] if failures else ""
            decision = await self._deployment.step(model, r.version, lambda x: x.tick(now, ready, window, failed))
            if self._decisions is not None and decision is not None:
                self._decisions.labels(model, str(decision.state)).inc()
            if self._weights is not None:
                weight = decision.weight if decision is not None else r.weight
                if decision is not None and decision.state.ended:
                    if (model, r.version) in self._shown:
                        self._weights.remove(model, r.version)
                        self._shown.discard((model, r.version))
                else:
                    self._weights.labels(model, r.version).set(weight)
                    self._shown.add((model, r.version))
        if self._autoscalers is not None:
            qos = view.spec.policy if view.spec is not None else None
            await self._autoscalers.look(scaled, self._clock(), self._windows,
                                         lambda tier: float(qos(tier).ttft_target_ms) if qos else 0.0)

    async def _read_outcomes(self, window_s: float) -> None:
        if not self._windows:
            self._last_id = ""
            return
        if not self._last_id:
            # A new leader: the last window's worth first.
            self._last_id = f"{int((self._clock() - window_s) * 1000)}-0"
        while True:
            got = await self._redis.xread({OUTCOMES_STREAM: self._last_id}, count=READ_COUNT)
            if not got:
                return
            entries = got[0][1]
            for entry_id, fields in entries:
                self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                raw = fields.get(b"o") or fields.get("o")
                try:
                    rows = json.loads(raw)
                except (TypeError, ValueError):
                    continue
                for row in rows:
                    try:
                        o = Outcome.decode(row)
                    except (TypeError, ValueError):
                        continue
                    if (w := self._windows.get(o.model)) is not None:
                        w.add(o)
            if len(entries) < READ_COUNT:
                return

    async def _ready(self, view: View, r: Rollout) -> bool:
        """Whether the new version's workers can take its share: one serving worker for a canary or
        shadow; for blue-green, which takes everything at once, as many as its pool declares (auto:
        as many as the stable version has), at least one."""
        workers = await self._registry.list(r.model)
        mine = sum(1 for w in workers if w.model_version == r.version and w.state == SERVING)
        if r.policy.strategy is not Strategy.BLUE_GREEN:
            return mine >= 1
        stable = sum(1 for w in workers if w.model_version == r.stable and w.state == SERVING)
        declared = view.models.get(r.model)
        want = declared.replicas if declared is not None and declared.replicas != "auto" else stable
        return mine >= max(1, min(int(want), stable) if stable else int(want or 1))
