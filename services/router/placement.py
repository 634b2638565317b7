"""Stage 5's decision (services/router/pipeline.py): where a prepared request runs. The scheduler's
view of the request (the KV directory's answer gathered, the requests this router sent each worker
since its last load report), its pick within the workers' batching windows or a wait in the
router's queue (services/router/flow.py), the blocks provisioned in the KV directory where they will
be, and what the worker is sent. On the direct path the placement is all the router does: it holds
the request's room until the worker's report of its end (end_direct)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from gaas.contracts import batches as batch_terms
from gaas.contracts import errors, finish, latency
from gaas.contracts.principal import Principal
from gaas.v1 import common_pb2, worker_pb2
from services.router.activity import TenantActivity
from services.router.breakers import prompt_work
from services.router.coalescing import Coalescing
from services.router.directory import MeshDirectory
from services.router.flow import Flow
from services.router.holding import DECISION_HOLD_S
from services.router.outcomes import Outcomes, RouterMetrics
from services.router.prepare import Prepared
from services.router.scheduling import Candidate, RequestContext, Scheduler, WorkerId
from services.router.scheduling.hooks import Hooks
from services.router.scheduling.types import Response

log = logging.getLogger(__name__)

# Whom the KV directory counts blocks under a public prefix for.
PUBLIC_OWNER = "(public)"


class Inflight:
    """Requests this router sent each worker, with when: what a worker's last load report cannot
    know yet is added to it (so a burst does not pile onto the worker that looked idle)."""

    def __init__(self) -> None:
        self._started: dict[WorkerId, dict[int, int]] = {}
        self._next = 0

    def start(self, worker: WorkerId) -> int:
        self._next += 1
        self._started.setdefault(worker, {})[self._next] = int(time.time() * 1000)
        return self._next

    def finish(self, worker: WorkerId, token: int) -> None:
        self._started.get(worker, {}).pop(token, None)

    def since(self, worker: WorkerId, reported_ms: int) -> int:
        """Requests still running that were sent to worker after it reported at reported_ms."""
        return sum(1 for t in self._started.get(worker, {}).values() if t > reported_ms)

    @property
    def total(self) -> int:
        return sum(len(v) for v in self._started.values())



@dataclass(slots=True)
class DirectPlacement:
    """A request placed for the ingress to send straight to its worker (Placer.place_direct):
    its room in the worker's window and its place in flight are held until ended() says how the
    worker did."""

    placer: "Placer"
    prepared: Prepared
    principal: Principal
    worker: Candidate
    request: worker_pb2.WorkerGenerateRequest
    queued_s: float
    token: int
    # Leading blocks of the prompt the KV directory said the worker holds.
    confirmed_blocks: int = 0
    # Every engine request it is (a prompt list's, in order; empty: request alone).
    requests: list[worker_pb2.WorkerGenerateRequest] = field(default_factory=list)
    # The other workers that may serve it, best first: the first is where the ingress sends it
    # should the worker not take it; the worker carries its stream on at them should its engine
    # stop mid-stream.
    others: list[Candidate] = field(default_factory=list)
    # With no other: a worker whose breaker is open, named second all the same (the ingress's
    # retry otherwise goes to any worker of the mesh, which refuses what it was not sent).
    last_resort: Candidate | None = None
    done: bool = False

    @property
    def prompts(self) -> list[worker_pb2.WorkerGenerateRequest]:
        """What the worker runs: every engine request of it, in order."""
        return self.requests or [self.request]

    @property
    def fallback(self) -> Candidate | None:
        return self.others[0] if self.others else self.last_resort

    @property
    def addresses(self) -> str:
        """What the ingress is told (x-gaas-worker): the worker, then the second choice."""
        return ",".join(w.address for w in (self.worker, self.fallback) if w is not None)

    def ended(self, code: grpc.StatusCode | None, detail: str = "", final: common_pb2.GenerateChunk | None = None,
              by: str = "") -> None:
        """The request is over. code: the worker's status (None: unknown, the client went away or
        the ingress never reached the worker); final: the worker's final chunk, without its text
        (usage, finish reason, the latency decomposition), when it finished; by: the worker that
        ended it (the final chunk's, when there is one)."""
        if self.done:
            return
        self.done = True
        self.placer.end_direct(self, code, detail, final, by or (final.worker_id if final is not None else ""))


@dataclass(frozen=True, slots=True)
class Placed:
    """One placement (Placer.place): the worker, the seconds the request waited in the queue for
    it, the token of its room there (Inflight), and every candidate's score."""

    worker: Candidate
    queued_s: float
    token: int
    scores: dict[WorkerId, float]


class Placer:
    def __init__(self, directory: MeshDirectory, scheduler: Scheduler, flow: Flow, hooks: Hooks, inflight: Inflight,
                 metrics: RouterMetrics, outcomes: Outcomes, activity: TenantActivity, coalescing: Coalescing) -> None:
        self._directory = directory
        self._scheduler = scheduler
        self._flow = flow
        self._hooks = hooks
        self._metrics = metrics
        self._outcomes = outcomes
        self.activity = activity
        self._coalescing = coalescing
        self._inflight = inflight

    async def context(self, prepared: Prepared, principal: Principal, workers) -> RequestContext:
        """The scheduler's view of the request: what the KV directory knows of its prompt, and
        what the pre-cycle hooks gather (the requests sent each worker since its last report)."""
        req = prepared.request
        ctx = RequestContext(
            model=prepared.model.name, tenant=principal.tenant, tier=principal.tier,
            prompt_tokens=prepared.prompt_tokens, max_tokens=req.max_tokens,
            session_worker=WorkerId(prepared.session_worker), block_hashes=prepared.block_hashes,
            prefix=prepared.prefix.matched if prepared.prefix else {},
            confirmed=prepared.prefix.confirmed if prepared.prefix else {},
            cache_owner=principal.tenant if prepared.cache_salt == principal.cache_salt else PUBLIC_OWNER,
            adapter=prepared.model.adapter.name if prepared.model.adapter is not None else "",
        )
        await self._hooks.before(ctx, workers)
        return ctx

    async def place(
        self, prepared: Prepared, principal: Principal, ctx: RequestContext, workers, time_remaining: float | None,
        span, attempt: int = 0, hold_s: float | None = None,
    ) -> Placed:
        """One placement: the scheduler's pick within the windows (waiting in the queue when they
        are full, hold_s at most), the decision on the request's span, the post-cycle hooks (the
        prefix's blocks provisioned where they will be...), the request counted in flight there."""
        placing = time.perf_counter()
        decision = await self._flow.place(self._scheduler, ctx, workers, principal.band_name, principal.tenant,
                                          time_remaining, hold_s)
        queued_s = time.perf_counter() - placing
        worker = decision.worker
        if span.is_recording():
            span.set_attributes({
                "gaas.worker": worker.worker_id, "gaas.policy": self._scheduler.name, "gaas.attempt": attempt,
                "gaas.queue_ms": round(queued_s * 1000, 3),
                "gaas.prefix_tokens": ctx.prefix.get(worker.worker_id, 0) * worker.block_size,
                "gaas.scores": ", ".join(f"{w}={s:.3g}" for w, s in sorted(decision.scores.items())),
            })
        self._hooks.picked(ctx, worker, workers)
        return Placed(worker, queued_s, self._inflight.start(worker.worker_id), decision.scores)

    def worker_request(self, prepared: Prepared, principal: Principal, request_id: str) -> worker_pb2.WorkerGenerateRequest:
        """What the worker is sent: the prepared request, with the tier's engine priority and the
        stream's coalescing for this router's load."""
        worker_request = worker_pb2.WorkerGenerateRequest(
            request=prepared.request, request_id=request_id, cache_salt=prepared.cache_salt
        )
        if prepared.cached_cap is not None:
            worker_request.cached_tokens_cap = prepared.cached_cap
        if (a := prepared.model.adapter) is not None:
            worker_request.adapter.name, worker_request.adapter.adapter_id, worker_request.adapter.path = (
                a.name, a.adapter_id, a.path)
        # Fuller messages as this router's streams grow (the first token still goes alone).
        interval = self._coalescing.interval(self._inflight.total)
        if principal.batch:
            # Nobody reads a batch item as it comes: the fewest messages (the least CPU per token).
            interval = batch_terms.STREAM_INTERVAL
        if interval > 1:
            worker_request.stream_interval = interval
        priority = self._flow.engine_priority(principal.band_name, prepared.request.priority)
        if priority is not None:
            worker_request.engine_priority = priority
        return worker_request

    async def place_direct(
        self, prepared: Prepared, principal: Principal, request_id: str, time_remaining: float | None,
    ) -> "DirectPlacement":
        """Place a request that the ingress will send to the worker itself (ingress.path: direct):
        the same decision as for a stream of the router's own, without a retry (the router is out
        of the stream); the caller reports its end (DirectPlacement.ended)."""
        workers = await self._directory.workers(prepared.model.name, prepared.model.pool)
        ctx = await self.context(prepared, principal, workers)
        self.activity.started(principal.tenant, principal.tier)
        try:
            placed = await self.place(prepared, principal, ctx, workers, time_remaining, trace.get_current_span(),
                                      hold_s=DECISION_HOLD_S)
        except BaseException:
            self.activity.finished(principal.tenant, 0)
            raise
        worker, scores = placed.worker, placed.scores
        # The other workers whose breakers let requests through, best-scored first: the second
        # choice, should the first not take the request (the ingress then sends it there), and
        # where the worker carries its stream on should its engine stop mid-stream.
        blocked = self._flow.breakers.blocked()
        others = sorted((w for w in workers if w.worker_id != worker.worker_id and w.worker_id not in blocked),
                        key=lambda w: scores.get(w.worker_id, float("-inf")), reverse=True)
        last_resort = None if others else await self._last_resort(prepared, worker, workers)
        return DirectPlacement(self, prepared, principal, worker, self.worker_request(prepared, principal, request_id),
                               placed.queued_s, placed.token, ctx.confirmed.get(worker.worker_id, 0), others=others,
                               last_resort=last_resort)

    async def _last_resort(self, prepared: Prepared, worker: Candidate, workers: list[Candidate]) -> Candidate | None:
        """The second choice when no other worker of the request's pool lets requests through: a
        worker of another version of the model that does (a canary's only worker draining or full:
        the stable version serves it, and the reverse), else one of the pool whose breaker is open.
        Without one the ingress's retry reaches any worker of the mesh, which refuses what it was
        not sent."""
        if prepared.model.pool:
            blocked = self._flow.breakers.blocked()
            try:
                model_workers = await self._directory.workers(prepared.model.name)
            except errors.Unavailable:
                model_workers = []
            if (w := next((w for w in model_workers if w.worker_id != worker.worker_id and w.worker_id not in blocked),
                          None)) is not None:
                return w
        return next((w for w in workers if w.worker_id != worker.worker_id), None)

    def end_direct(self, p: DirectPlacement, code: grpc.StatusCode | None, detail: str,
                   final: common_pb2.GenerateChunk | None, by: str = "") -> None:
        """A direct generation is over: the flow learns how its worker did, and the request is
        recorded as one of the router's own streams is (Relay.stream), from the worker's final."""
        worker, m, labels = p.worker.worker_id, self._metrics, (p.prepared.model.name, p.principal.band_name)
        tokens = 0
        if by and by != worker:
            # The ingress found the worker would not take it (unreachable, busy) and sent it to the
            # second choice, which served it (or failed it: that counts against the second).
            self._hooks.failed(Response(worker, p.principal.band_name, code=grpc.StatusCode.UNAVAILABLE,
                                        detail="did not take a request the ingress sent it"))
            worker = WorkerId(by)
        if final is not None:
            t, u = final.timings, final.usage
            # What the tenant waited for the first token, from the ingress's arrival; the window's
            # measure leaves out the ingress's hop and the router's queue, as for the router's streams.
            seen_ms = latency.first_token_ms(t)
            self._hooks.first_token(Response(worker, p.principal.band_name, t.ttft_ms,
                                             seen_ms - t.ingress_ms - t.router_queue_ms,
                                             prompt_work(u.prompt_tokens - u.cached_tokens)))
            outcome = finish.label(final.finish_reason)
            if m.ttft_seconds is not None:
                m.ttft_seconds.labels(*labels).observe(seen_ms / 1000)
            tokens = self._outcomes.count(labels, u, t.decode_ms / 1000)
            self._outcomes.observe_latency(t, p.principal.band_name)
            log.info("served for %s by %s straight to the ingress: %d prompt (%d cached, %d blocks predicted) + %d "
                     "completion tokens, %s, TTFT %.1f ms at the worker", p.principal.tenant, worker, u.prompt_tokens,
                     u.cached_tokens, p.confirmed_blocks, u.completion_tokens,
                     common_pb2.FinishReason.Name(final.finish_reason), t.ttft_ms)
            if worker == p.worker.worker_id:
                self._hooks.served(Response(worker, p.principal.band_name, cached_tokens=u.cached_tokens,
                                            confirmed_blocks=p.confirmed_blocks, block_size=p.worker.block_size))
            self._outcomes.rollout(p.prepared.model, p.principal.band_name, True, seen_ms, u.completion_tokens,
                                   t.decode_ms / 1000)
        elif code is not None and code != grpc.StatusCode.OK:
            self._hooks.failed(Response(worker, p.principal.band_name, code=code, detail=detail))
            self._outcomes.rollout(p.prepared.model, p.principal.band_name, False)
            outcome = code.name
        else:
            outcome = "cancelled"
        if m.requests is not None:
            m.requests.labels(*labels, outcome).inc()
        # The room taken was the first choice's.
        self._inflight.finish(p.worker.worker_id, p.token)
        self._hooks.ended(Response(p.worker.worker_id, p.principal.band_name))
        self.activity.finished(p.principal.tenant, tokens)
