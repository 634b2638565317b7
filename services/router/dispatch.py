"""Taking a generation to a worker: resolve the model, check the request, pick a worker, forward
the stream through the sidecar (naming the worker in x-gaas-worker), relay the chunks. Retries on
another worker only while no token has been relayed, so a client never sees a token twice.

Both public APIs (gaas.v1.Inference and the OpenAI-compatible one) go through here; failures are
DispatchError carrying the status code the caller should get.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from gaas import genrequest
from gaas.runtime.context import WORKER_HEADER
from gaas.v1 import common_pb2, inference_pb2, worker_pb2, worker_pb2_grpc
from services.router.auth import Principal
from services.router.directory import MeshDirectory, ModelEntry, UnknownModel
from services.router.picker import NoWorkerAvailable, Picker, WorkerId

log = logging.getLogger(__name__)

# Codes that mean "this worker could not take the request": another may.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}


class DispatchError(Exception):
    """The request failed; code is the gRPC status to answer with, message what to do."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Dispatcher:
    def __init__(
        self,
        directory: MeshDirectory,
        picker: Picker,
        worker_stub: worker_pb2_grpc.WorkerStub,
        *,
        retries: int,
        max_stream_seconds: float,
    ) -> None:
        self._directory = directory
        self._picker = picker
        self._workers = worker_stub
        self._retries = retries
        self._max_stream_seconds = max_stream_seconds

    async def _ask(self, fn, *args):
        """Directory calls, with their failures as DispatchError."""
        try:
            return await fn(*args)
        except UnknownModel as exc:
            raise DispatchError(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except NoWorkerAvailable as exc:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except grpc.aio.AioRpcError as exc:
            log.warning("control plane unreachable: %s %s", exc.code().name, exc.details())
            raise DispatchError(grpc.StatusCode.UNAVAILABLE, "the control plane is unreachable; retry shortly") from None

    async def models(self) -> list[tuple[ModelEntry, int]]:
        """The deployed models, each with how many serving workers it has now."""
        snap = await self._ask(self._directory.snapshot)
        ready: dict[str, int] = {}
        for w in snap.workers:
            ready[w.model] = ready.get(w.model, 0) + 1
        return [(m, ready.get(m.name, 0)) for m in snap.models]

    async def resolve_model(self, name: str) -> ModelEntry:
        return await self._ask(self._directory.resolve_model, name)

    async def stream(
        self,
        request: inference_pb2.GenerateRequest,
        principal: Principal,
        request_id: str,
        time_remaining: float | None,
        arrived: float,
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        """The chunks of request, from whichever worker takes it. request.model may be empty."""
        model = await self.resolve_model(request.model)
        try:
            genrequest.check(request, model.max_model_len or None)
        except genrequest.RequestInvalid as exc:
            raise DispatchError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        forwarded = inference_pb2.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.model = model.name
        forwarded.request_id = request_id
        worker_request = worker_pb2.WorkerGenerateRequest(
            request=forwarded, request_id=request_id, cache_salt=principal.cache_salt
        )
        timeout = self._max_stream_seconds if time_remaining is None else min(time_remaining, self._max_stream_seconds)

        tried: set[WorkerId] = set()
        sent_any = False
        for attempt in range(self._retries + 1):
            worker = self._picker.pick(await self._ask(self._directory.candidates, model.name, tried))
            tried.add(worker.worker_id)
            router_ms = (time.perf_counter() - arrived) * 1000
            call = self._workers.Generate(worker_request, timeout=timeout, metadata=((WORKER_HEADER, worker.address),))
            try:
                async for chunk in call:
                    if chunk.finish_reason:
                        chunk.timings.router_ms = router_ms
                        chunk.tenant = principal.tenant
                        log.info(
                            "served for %s by %s: %d prompt (%d cached) + %d completion tokens, %s, "
                            "TTFT %.1f ms at the worker",
                            principal.tenant, worker.worker_id, chunk.usage.prompt_tokens, chunk.usage.cached_tokens,
                            chunk.usage.completion_tokens, common_pb2.FinishReason.Name(chunk.finish_reason),
                            chunk.timings.ttft_ms,
                        )
                    sent_any = True
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if not sent_any and code in RETRYABLE and attempt < self._retries:
                    log.warning("worker %s failed before its first token (%s: %s); trying another",
                                worker.worker_id, code.name, exc.details())
                    self._directory.eject(worker.worker_id)
                    continue
                if code == grpc.StatusCode.UNAVAILABLE:
                    self._directory.eject(worker.worker_id)
                raise DispatchError(code, exc.details() or f"worker {worker.worker_id} failed") from None
            finally:
                # A client that went away cancels the caller; take the worker's stream with it.
                call.cancel()
