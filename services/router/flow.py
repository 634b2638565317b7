"""Flow control in the router: how a scheduled request gets its worker under load. The tier's
priority band orders everything (gaas.contracts.qos); each worker has a dynamic batching window
(services/router/windows.py); requests no window has room for wait in a bounded queue, best band
first and fair between tenants (services/router/waitqueue.py), until their tier's queue timeout;
workers that fail in bursts or slow down past their own p99 are cut off by circuit breakers
(services/router/breakers.py) and probed back.

The placement (placement.Placer) calls place() to get a worker (the scheduler decides; this only says whether there
is room, and waits for it), then started / first_token / failed / finished as the stream goes.
With QoS off (GAAS_QOS=off: for comparison) there are no bands, windows or queue: every request
goes to a worker at once, at the priority its client asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from gaas.contracts import qos
from gaas.contracts.qos import BAND_NAMES, TierPolicy
from gaas.contracts.tenancy import DEFAULT_TIER
from gaas.contracts.ids import WorkerId
from services.router.breakers import Breakers
from services.router.scheduling import Candidate, Decision, RequestContext, Scheduler
from services.router.scheduling.types import NoCapacity
from services.router.waitqueue import WaitQueue
from services.router.windows import Windows

log = logging.getLogger(__name__)

# Worker answers that say "not now" (its queue is full), not "broken".
BUSY = {grpc.StatusCode.RESOURCE_EXHAUSTED}
# Failures that say the worker cannot even be reached.
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE}


@dataclass(frozen=True, slots=True)
class FlowSettings:
    enabled: bool = True
    # Most requests waiting in this router's queue.
    max_waiting: int = 256
    # Batching windows: start, floor and ceiling (requests per worker).
    window_initial: int = 8
    window_min: int = 4
    window_max: int = 64
    breaker_cooldown_seconds: float = 5.0


class Flow:
    def __init__(
        self, policies: Mapping[str, TierPolicy], settings: FlowSettings = FlowSettings(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._policies = dict(policies)
        self._clock = clock
        self.windows = Windows({t: p.ttft_target_ms for t, p in self._policies.items()},
                               initial=settings.window_initial, minimum=settings.window_min,
                               maximum=settings.window_max, clock=clock)
        self.breakers = Breakers(cooldown_seconds=settings.breaker_cooldown_seconds, clock=clock,
                                 on_change=self._breaker_changed)
        self.queue = WaitQueue(settings.max_waiting, clock=clock)

    def policy(self, tier: str) -> TierPolicy:
        return self._policies.get(tier) or qos.DEFAULT_POLICIES.get(tier) or qos.DEFAULT_POLICIES[DEFAULT_TIER]

    def engine_priority(self, tier: str, client_priority: int) -> int | None:
        """vLLM priority for the request (None with QoS off: the client's own)."""
        return qos.engine_priority(tier, client_priority) if self.settings.enabled else None

    async def place(
        self, scheduler: Scheduler, ctx: RequestContext, workers: Sequence[Candidate], tier: str, tenant: str,
        time_remaining: float | None, hold_s: float | None = None,
    ) -> Decision:
        """The worker for the request, with room taken in its window (wait for it in the queue when
        every window is full, hold_s at most: the ingress's wait on a decision). errors.Unavailable
        when no worker may take it, DeadlineExceeded when none had room in time, Unavailable
        ("overloaded") when shed."""
        band = qos.band(tier) if self.settings.enabled else 0
        ctx.band = band
        worker_ids = [w.worker_id for w in workers]

        def place_now() -> Decision | None:
            ctx.blocked = self.breakers.blocked()
            ctx.room = self.windows.room(worker_ids, band) if self.settings.enabled else None
            try:
                decision = scheduler.schedule(ctx, workers)
            except NoCapacity:
                return None
            self.windows.acquire(decision.worker.worker_id, batch=tier == qos.BATCH)
            self.breakers.started(decision.worker.worker_id)
            return decision

        if not self.settings.enabled or not self.queue.ahead(band):
            decision = place_now()
            if decision is not None:
                return decision
        policy = self.policy(tier)
        wait = policy.queue_timeout_s
        why = f"the {tier} tier's queue timeout is {policy.queue_timeout_s:g} s"
        if time_remaining is not None and time_remaining < wait:
            wait, why = time_remaining, "the request's deadline"
        if hold_s is not None and hold_s < wait:
            wait, why = hold_s, f"the ingress waits on a decision at most {hold_s:g} s"
        return await self.queue.wait(
            band, tenant, ctx.model, self._clock() + wait, place_now, why,
            abandon=lambda decision: self.finished(decision.worker.worker_id, batch=tier == qos.BATCH),
        )

    def first_token(self, worker: WorkerId, tier: str, ttft_ms: float, seen_ms: float | None = None,
                    work: float = 1.0) -> None:
        """worker sent a request's first token ttft_ms after it was sent there; seen_ms: after the
        request reached this router, less its wait in the queue (default ttft_ms); work: its
        prompt's (breakers.prompt_work)."""
        self.breakers.success(worker, ttft_ms, work)
        if self.settings.enabled:
            self.windows.observe(worker, tier, ttft_ms if seen_ms is None else seen_ms)

    def succeeded(self, worker: WorkerId) -> None:
        """worker ended a request well without producing a token (nothing to time)."""
        self.breakers.success(worker)

    def slow(self, worker: WorkerId, threshold_ms: float) -> None:
        """worker has not produced a first token within its threshold: a failure for its breaker."""
        self.breakers.failure(worker, f"no first token within {threshold_ms:.0f} ms")

    def failed(self, worker: WorkerId, code: grpc.StatusCode, detail: str) -> None:
        if code in BUSY:
            if self.settings.enabled:
                self.windows.shrink(worker)
            return
        if code == grpc.StatusCode.CANCELLED:
            return
        self.breakers.failure(worker, f"{code.name}: {detail[:200]}", immediate=code in UNREACHABLE)

    def finished(self, worker: WorkerId, batch: bool = False) -> None:
        """The request (batch: of the batch band) left worker: its room goes to the next waiter."""
        self.windows.release(worker, batch)
        self.breakers.ended(worker)
        if self.settings.enabled:
            self.queue.dispatch()

    def forget(self, workers: Sequence[WorkerId]) -> None:
        self.windows.forget(workers)
        self.breakers.forget(workers)

    @staticmethod
    def _breaker_changed(worker: WorkerId, state: str, why: str) -> None:
        (log.warning if state == "open" else log.info)("circuit breaker of %s: %s (%s)", worker, state, why)


class FlowCollector:
    """Prometheus figures of a Flow, read at each scrape: the queue per band, each worker's window
    and breaker."""

    def __init__(self, flow: Flow, prefix: str = "gaas_router") -> None:
        self._flow = flow
        self._prefix = prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p, flow = self._prefix, self._flow
        waiting = GaugeMetricFamily(f"{p}_queue_waiting", "Requests waiting for room, by band", labels=["band"])
        events = CounterMetricFamily(f"{p}_queue", "Queue outcomes, by band", labels=["band", "outcome"])
        for band, stats in enumerate(flow.queue.stats):
            name = BAND_NAMES[band]
            waiting.add_metric([name], stats.waiting)
            for outcome in ("queued", "admitted", "shed", "timed_out"):
                events.add_metric([name, outcome], getattr(stats, outcome))
        window = GaugeMetricFamily(f"{p}_window", "Each worker's batching window (requests)", labels=["worker"])
        in_flight = GaugeMetricFamily(f"{p}_window_in_flight", "Requests in each worker's window", labels=["worker"])
        for worker, w in flow.windows.state().items():
            window.add_metric([worker], w.limit)
            in_flight.add_metric([worker], w.in_flight)
        breaker = GaugeMetricFamily(f"{p}_breaker_open", "1 while a worker's circuit breaker is open or "
                                    "half-open", labels=["worker"])
        trips = CounterMetricFamily(f"{p}_breaker_trips", "Times each worker's breaker opened", labels=["worker"])
        for worker, b in flow.breakers.state().items():
            breaker.add_metric([worker], 0 if b.state == "closed" else 1)
            trips.add_metric([worker], b.trips)
        yield from (waiting, events, window, in_flight, breaker, trips)
