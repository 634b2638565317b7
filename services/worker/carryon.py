"""A direct stream that outlives this worker's engine (topology ingress.path: direct): the ingress
streams from this worker's front end (this process), and when the engine under it stops after
tokens went out (it died, or the worker is stopping and hands its streams over), the front end
carries the stream on at another worker serving the model, as the router does on its own route
(gaas.contracts.continuation): the prompt plus the token ids sent as the new prompt, the rest of
max_tokens, the same sampling and seed, through this worker's sidecar to the other's
(gaas.v1.Worker/Generate). The client sees one stream and one usage; the recomputed prefill is
the mesh's cost (gaas_worker_stream_moved_prefill_tokens_total), not the tenant's.

What it cannot outlive is this process itself (kill -9 of the front end, a lost host): the stream
is the connection from the ingress to it, and after a reset no Envoy can resume a response. The
router path (ingress.path: router) keeps a process of another host in every stream for that.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from gaas.contracts import errors
from gaas.contracts.continuation import Carried
from gaas.runtime.context import WORKER_HEADER
from gaas.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)

# The longest a carried-on stream may run at the next worker.
CARRIED_STREAM_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class CarryOnMetrics:
    # Streams carried on by outcome: moved (another worker took it), failed (none could).
    moves: object = None
    # Prompt tokens the workers that carried streams on computed again (the mesh's cost).
    moved_prefill_tokens: object = None

    def count(self, outcome: str) -> None:
        if self.moves is not None:
            self.moves.labels(outcome).inc()


class CarryOn:
    def __init__(self, worker: WorkerServicer, peers: worker_pb2_grpc.WorkerStub | None, address: str = "",
                 metrics: CarryOnMetrics = CarryOnMetrics()) -> None:
        self._worker = worker
        # This worker's own address (the ingress may have sent it the request as the second choice,
        # which the router lists among the others).
        self._address = address
        # Other workers, through this worker's sidecar (None: it runs standalone, with no one to ask).
        self._peers = peers
        self._metrics = metrics

    async def stream(self, request: worker_pb2.WorkerGenerateRequest, carry_on: list[str], context,
                     on_abandoned: Callable | None = None) -> AsyncIterator[common_pb2.GenerateChunk]:
        """The request's chunks from this worker's engine and, should it stop after tokens went out,
        from the workers of carry_on (their sidecars' addresses, best first; each tried once: the
        router lists as many as it allows moves). A failure before the first token is raised (the
        ingress then tries the router's second choice)."""
        carried = Carried(len(request.request.prompt_token_ids))
        try:
            async for chunk in self._worker.Generate(request, context, on_abandoned=on_abandoned):
                carried.seen(chunk)
                yield chunk
            return
        except errors.Unavailable as exc:  # the engine stopped: died, or handed its streams over
            if not carried.sent or not carried.can_carry_on(request, "UNAVAILABLE"):
                raise
            reason = exc.message
        async for chunk in self._elsewhere(request, carried, carry_on, reason):
            yield chunk

    async def _elsewhere(self, request: worker_pb2.WorkerGenerateRequest, carried: Carried, carry_on: list[str],
                         reason: str) -> AsyncIterator[common_pb2.GenerateChunk]:
        """The rest of the stream, from the first worker of carry_on that carries it on."""
        request_id = request.request_id
        for address in carry_on:
            if self._peers is None:
                break
            if address == self._address:
                continue
            cont = carried.continuation(request)
            if cont is None:  # its last token went out: only its end is left to tell
                info = self._worker.engine.info
                yield carried.ended(request_id, self._worker.worker_id, info.model, info.model_version)
                return
            carried.moves += 1
            before = len(carried.sent)
            log.warning("request %s: stopped after %d tokens (%s); %s carries the stream on", request_id, before,
                        reason, address)
            call = self._peers.Generate(cont, timeout=CARRIED_STREAM_SECONDS, metadata=((WORKER_HEADER, address),))
            try:
                async for chunk in call:
                    if chunk.HasField("prefill") and self._metrics.moved_prefill_tokens is not None:
                        self._metrics.moved_prefill_tokens.inc(carried.recomputed(chunk))
                    carried.adjust(chunk, before)
                    carried.seen(chunk)
                    yield chunk
                self._metrics.count("moved")
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if not carried.can_carry_on(cont, code.name):
                    self._metrics.count("failed")
                    log.warning("request %s: %s refused its continuation (%s: %s)", request_id, address, code.name,
                                exc.details())
                    raise _cannot_go_on(request_id) from None
                reason = f"{address} failed ({code.name}: {exc.details()})"
            finally:
                call.cancel()
        self._metrics.count("failed")
        log.warning("request %s: stopped after %d tokens (%s), and no other worker could carry the stream on",
                    request_id, len(carried.sent), reason)
        raise _cannot_go_on(request_id)


def _cannot_go_on(request_id: str) -> errors.Unavailable:
    return errors.Unavailable(
        f"the worker serving this request failed after it had streamed tokens, and no other worker could carry it "
        f"on (request id {request_id}); the request may be retried")
