"""Stage 5's stream (services/router/pipeline.py): a prepared request taken to the worker the
placement picks, through the worker's sidecar (naming the worker in x-gaas-worker) with the tier's
engine priority, its chunks relayed, and the flow told how the worker did (first token time,
failures: windows and circuit breakers). Retries on another worker while no token has been
relayed; after that, a worker that fails is replaced by another that carries the stream on from
the tokens sent (gaas.contracts.continuation), so a client never sees a token twice nor a worker's death."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace

from gaas.contracts import errors, finish, latency
from gaas.contracts.continuation import Carried
from gaas.contracts.principal import Principal
from gaas.runtime import status
from gaas.runtime.context import WORKER_HEADER
from gaas.v1 import common_pb2, worker_pb2_grpc
from services.router.activity import TenantActivity
from services.router.breakers import prompt_work
from services.router.directory import MeshDirectory
from services.router.flow import Flow
from services.router.outcomes import Outcomes, RouterMetrics
from services.router.placement import Inflight, Placer
from services.router.prepare import Prepared
from services.router.scheduling import WorkerId
from services.router.scheduling.hooks import Hooks
from services.router.scheduling.types import Response

log = logging.getLogger(__name__)

# Codes that mean "this worker could not take the request": another may.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
# What the router's own sidecar answers for a worker its membership (control's xDS) does not hold
# yet: a worker that has just registered, announced to the router and pushed to its Envoy at once.
# Not the worker's failure: the same choice is tried again after a pause, a few times at most.
SIDECAR_UNKNOWN = "no healthy upstream"
SIDECAR_LAG_PAUSE_S = 0.2
SIDECAR_LAG_TRIES = 10
# How long a call whose client left before its first chunk still waits for it (the worker's own
# bound, services.worker.engine.ABANDONED_FIRST_OUTPUT_S, and a little more).
ABANDONED_FIRST_CHUNK_S = 35.0


class Relay:
    def __init__(self, directory: MeshDirectory, placer: Placer, worker_stub: worker_pb2_grpc.WorkerStub, flow: Flow,
                 hooks: Hooks, inflight: Inflight, metrics: RouterMetrics, outcomes: Outcomes, activity: TenantActivity,
                 *, retries: int, max_stream_seconds: float, moves: int = 0) -> None:
        self._directory = directory
        self._placer = placer
        self._workers = worker_stub
        self._flow = flow
        self._hooks = hooks
        self._metrics = metrics
        self._outcomes = outcomes
        self.activity = activity
        self._inflight = inflight
        self._retries = retries
        # Times a stream is carried on by another worker when its own fails mid-stream.
        self._moves = moves
        self._max_stream_seconds = max_stream_seconds
        # Calls whose client left before their first chunk, running on to it.
        self._abandoned: set[asyncio.Future] = set()

    async def stream(
        self,
        prepared: Prepared,
        principal: Principal,
        request_id: str,
        time_remaining: float | None,
        arrived: float,
        tenant_s: float = 0.0,
        ingress_s: float = 0.0,
        on_abandoned: Callable[[asyncio.Future], None] | None = None,
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        """The chunks of a prepared request, from whichever worker the scheduler picks. arrived:
        the router's arrival (perf_counter); tenant_s: its admission so far; ingress_s: ingress to
        router. The last chunk carries the request's latency decomposition (latency.complete).
        Each request is counted by its outcome, with its tokens, TTFT and time per output token.
        on_abandoned: told, with a future of the worker's first chunk, when the client leaves after
        the request reached a worker and before that chunk (the metering side bills it)."""
        m = self._metrics
        labels = (prepared.model.name, principal.tier)
        outcome = "cancelled"
        first_at = last_at = None
        tokens = completion = 0
        failed = False
        self.activity.started(principal.tenant, principal.tier)
        try:
            async for chunk in self._stream(prepared, principal, request_id, time_remaining, arrived, tenant_s,
                                            ingress_s, on_abandoned):
                if first_at is None and chunk.token_ids:
                    first_at = time.perf_counter()
                    if m.ttft_seconds is not None:
                        m.ttft_seconds.labels(*labels).observe(ingress_s + first_at - arrived)
                if chunk.HasField("usage"):
                    outcome = finish.label(chunk.finish_reason)
                    last_at = time.perf_counter()
                    completion = chunk.usage.completion_tokens
                    tokens = self._outcomes.count(labels, chunk.usage,
                                         None if first_at is None else last_at - first_at)
                yield chunk
        except errors.GaasError as exc:
            outcome, failed = exc.code, True
            raise
        except Exception:  # (a client going away stops the generator: outcome stays "cancelled")
            outcome, failed = "INTERNAL", True
            raise
        finally:
            self.activity.finished(principal.tenant, tokens)
            if m.requests is not None:
                m.requests.labels(*labels, outcome).inc()
            if failed or last_at is not None:  # (a client that left says nothing of the version)
                self._outcomes.rollout(
                    prepared.model, principal.tier, not failed,
                    None if first_at is None else (ingress_s + first_at - arrived) * 1000, completion,
                    0.0 if first_at is None or last_at is None else last_at - first_at)

    async def _stream(
        self,
        prepared: Prepared,
        principal: Principal,
        request_id: str,
        time_remaining: float | None,
        arrived: float,
        tenant_s: float,
        ingress_s: float,
        on_abandoned: Callable[[asyncio.Future], None] | None = None,
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        model = prepared.model
        workers = await self._directory.workers(model.name, model.pool)
        ctx = await self._placer.context(prepared, principal, workers)
        worker_request = self._placer.worker_request(prepared, principal, request_id)

        tried: set[WorkerId] = set()
        sent_any = False
        started = time.monotonic()
        # What the client has had, should its worker fail mid-stream and another carry it on.
        carried = Carried(prepared.prompt_tokens)
        request = worker_request
        # Tokens the client had before the worker now serving it (non-zero: a moved stream).
        before = 0

        def remaining() -> float | None:
            return None if time_remaining is None else max(0.0, time_remaining - (time.monotonic() - started))

        # The routing decision goes on the request's span (the router's server span, when traced).
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"gaas.request_id": request_id, "gaas.tenant": principal.tenant,
                                 "gaas.tier": principal.tier, "gaas.model": model.name,
                                 "gaas.stream_interval": worker_request.stream_interval or 1})
        loop = asyncio.get_running_loop()
        attempt = lagging = 0
        pause = False
        while True:
            if pause:
                pause = False
                await asyncio.sleep(SIDECAR_LAG_PAUSE_S)
            ctx.tried = frozenset(tried)
            moved = carried.moves > 0
            try:
                placed = await self._placer.place(prepared, principal, ctx, workers, remaining(), span,
                                                  attempt + carried.moves)
            except errors.GaasError:
                if not moved:
                    raise
                self._count_move(model.name, "failed")
                raise errors.Unavailable(
                    f"the worker serving this request failed after it had streamed tokens, and no other worker could "
                    f"carry it on (request id {request_id}); the request may be retried") from None
            worker, queued_s, token = placed.worker, placed.queued_s, placed.token
            tried.add(worker.worker_id)
            left = remaining()
            timeout = self._max_stream_seconds if left is None else min(left, self._max_stream_seconds)
            sent_at = time.perf_counter()
            # The first token's work: the prompt less what the directory says the worker caches.
            work = prompt_work(prepared.prompt_tokens + before - ctx.prefix.get(worker.worker_id, 0) * worker.block_size)
            threshold = self._flow.breakers.threshold_ms(worker.worker_id, work)
            watchdog = loop.call_later(threshold / 1000, self._flow.slow, worker.worker_id, threshold)
            call = self._workers.Generate(request, timeout=timeout, metadata=((WORKER_HEADER, worker.address),))
            first = True
            handed_off = False
            try:
                # Until its first chunk the worker's engine may be computing the prompt: a client
                # that leaves meanwhile leaves the call running to that chunk, which is billed
                # (on_abandoned; _run_to_first_chunk), rather than a prefill nobody pays for.
                reading = asyncio.ensure_future(call.read())
                try:
                    chunk = await asyncio.shield(reading)
                except asyncio.CancelledError:
                    handed_off = True
                    self._run_to_first_chunk(call, reading, worker.worker_id, token, on_abandoned)
                    raise
                while chunk is not grpc.aio.EOF:
                    if moved:
                        if chunk.HasField("prefill") and self._metrics.moved_prefill_tokens is not None:
                            self._metrics.moved_prefill_tokens.labels(model.name).inc(carried.recomputed(chunk))
                        carried.adjust(chunk, before)
                    if first and (chunk.token_ids or chunk.embeddings):
                        first = False
                        watchdog.cancel()
                        now = time.perf_counter()
                        # The worker's breaker judges the worker's own time; the window judges what the
                        # tenant waits for, less the queue the window itself decides (the router's
                        # own delays under load count: a smaller window relieves them too). A moved
                        # stream's client waited for its first token long before this worker.
                        worker_ms = (now - sent_at) * 1000
                        waited_ms = worker_ms if moved else (now - arrived - queued_s) * 1000
                        self._hooks.first_token(Response(worker.worker_id, principal.tier, worker_ms, waited_ms, work))
                    if chunk.HasField("usage"):
                        now = time.perf_counter()
                        latency.complete(chunk.timings, total_s=now - arrived, tenant_s=tenant_s,
                                         router_queue_s=queued_s, call_s=now - sent_at, ingress_s=ingress_s)
                        chunk.tenant = principal.tenant
                        if span.is_recording():
                            chunk.timings.trace_id = format(span.get_span_context().trace_id, "032x")
                        log.info(
                            "served for %s by %s%s: %d prompt (%d cached, %d blocks predicted) + %d completion "
                            "tokens, %s, TTFT %.1f ms at the worker",
                            principal.tenant, worker.worker_id, f" (moved {carried.moves}x)" if moved else "",
                            chunk.usage.prompt_tokens, chunk.usage.cached_tokens,
                            ctx.prefix.get(worker.worker_id, 0), chunk.usage.completion_tokens,
                            common_pb2.FinishReason.Name(chunk.finish_reason), chunk.timings.ttft_ms,
                        )
                        self._hooks.served(Response(
                            worker.worker_id, principal.tier, cached_tokens=chunk.usage.cached_tokens,
                            confirmed_blocks=ctx.confirmed.get(worker.worker_id, 0), block_size=worker.block_size,
                        ))
                    carried.seen(chunk)
                    sent_any = True
                    yield chunk
                    chunk = await call.read()
                if first:
                    self._hooks.succeeded(Response(worker.worker_id, principal.tier))
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if (not sent_any and code == grpc.StatusCode.UNAVAILABLE and exc.details() == SIDECAR_UNKNOWN
                        and lagging < SIDECAR_LAG_TRIES):
                    log.info("worker %s is not in this router's sidecar yet; trying it again shortly", worker.worker_id)
                    lagging += 1
                    pause = True
                    tried.discard(worker.worker_id)
                    continue
                self._hooks.failed(Response(worker.worker_id, principal.tier, code=code, detail=exc.details() or ""))
                if not sent_any and code in RETRYABLE and attempt < self._retries:
                    log.warning("worker %s failed before its first token (%s: %s); trying another",
                                worker.worker_id, code.name, exc.details())
                    attempt += 1
                    continue
                if not (sent_any and carried.can_carry_on(worker_request, code.name)):
                    raise self._worker_failure(worker.worker_id, exc, sent_any, request_id) from None
                if carried.moves >= self._moves:
                    self._count_move(model.name, "failed")
                    raise self._worker_failure(worker.worker_id, exc, sent_any, request_id) from None
                log.warning("worker %s failed after %d tokens of this stream (%s: %s); another worker carries it on",
                            worker.worker_id, len(carried.sent), code.name, exc.details())
                carried.moves += 1
                self._count_move(model.name, "moved")
                cont = carried.continuation(worker_request)
                if cont is None:  # its last token went out: only its end is left to tell
                    ending = carried.ended(request_id, worker.worker_id, model.name, model.version)
                    latency.complete(ending.timings, total_s=time.perf_counter() - arrived, tenant_s=tenant_s,
                                     router_queue_s=queued_s, call_s=time.perf_counter() - sent_at, ingress_s=ingress_s)
                    ending.tenant = principal.tenant
                    yield ending
                    return
                request, before = cont, len(carried.sent)
            finally:
                watchdog.cancel()
                if not handed_off:
                    # A client that went away cancels the caller; take the worker's stream with it.
                    call.cancel()
                    self._inflight.finish(worker.worker_id, token)
                    self._hooks.ended(Response(worker.worker_id, principal.tier))

    def _count_move(self, model: str, outcome: str) -> None:
        if self._metrics.moves is not None:
            self._metrics.moves.labels(model, outcome).inc()

    def _run_to_first_chunk(self, call, reading: asyncio.Future, worker: WorkerId, token: int,
                            on_abandoned: Callable[[asyncio.Future], None] | None) -> None:
        """The client left before the worker's first chunk: the call goes on until it comes (its
        worker keeps the engine request to it as well), then ends; on_abandoned gets a future of
        that chunk (None when the call failed or the engine never got to it in time), and the
        worker's room is given back only then."""

        async def finish() -> common_pb2.GenerateChunk | None:
            try:
                chunk = await asyncio.wait_for(reading, ABANDONED_FIRST_CHUNK_S)
                return None if chunk is grpc.aio.EOF else chunk
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - none came: nothing to bill
                return None
            finally:
                call.cancel()
                self._inflight.finish(worker, token)
                self._hooks.ended(Response(worker))

        task = asyncio.ensure_future(finish())
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        if on_abandoned is not None:
            on_abandoned(task)


    def _worker_failure(self, worker: WorkerId, exc: grpc.aio.AioRpcError, sent_any: bool, request_id: str) -> errors.GaasError:
        """What the client is told when worker failed the request (its detail stays in the log)."""
        code = exc.code()
        log.warning("worker %s failed (%s: %s)%s", worker, code.name, exc.details(), " mid-stream" if sent_any else "")
        if sent_any:
            return errors.Unavailable(
                f"the worker serving this request failed after it had streamed tokens (request id {request_id}); "
                "the request may be retried"
            )
        # The worker's own answers (invalid argument, busy...) are written for the caller; silence or a
        # cancelled call means no worker could take it; its own failure is its log's business.
        return status.from_peer(exc, "worker", passes=status.PEER_ANSWERS - {"CANCELLED"},
                                unanswered=status.UNANSWERED | {"CANCELLED"},
                                message="no worker could take the request right now; retry shortly",
                                request_id=request_id)
