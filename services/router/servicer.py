"""gaas.v1.Inference: validate, pick a worker, forward the stream through the sidecar naming the
worker in x-gaas-worker, and relay the chunks back. Retries on another worker only while no
token has been sent (so a client never sees a token twice)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gaas import genrequest
from gaas.runtime.context import WORKER_HEADER, current_request_id, request_id_var
from gaas.v1 import (
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.router.directory import MeshDirectory, ModelEntry, UnknownModel
from services.router.picker import Candidate, NoWorkerAvailable, Picker, WorkerId

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = 2.0
# Codes that mean "this worker could not take the request": another may.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}


def control_fetcher(stub: control_pb2_grpc.ControlStub):
    """fetch() for MeshDirectory: the deployed models and the serving workers, from control."""

    async def fetch() -> tuple[list[ModelEntry], list[Candidate]]:
        models_resp, workers_resp = await asyncio.gather(
            stub.ListModels(control_pb2.ListRegisteredModelsRequest(), timeout=CONTROL_TIMEOUT),
            stub.ListWorkers(control_pb2.ListWorkersRequest(), timeout=CONTROL_TIMEOUT),
        )
        models = [ModelEntry(m.name, m.version, m.max_model_len, m.is_default) for m in models_resp.models]
        workers = [
            Candidate(WorkerId(w.worker_id), w.address, w.model, w.model_version, w.max_model_len)
            for w in workers_resp.workers
            if w.state == control_pb2.WORKER_STATE_SERVING
        ]
        return models, workers

    return fetch


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
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

    async def _lookup(self, context, fn, *args):
        """Directory calls, with control-plane failures turned into UNAVAILABLE."""
        try:
            return await fn(*args)
        except UnknownModel as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except NoWorkerAvailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except grpc.aio.AioRpcError as exc:
            log.warning("control plane unreachable: %s %s", exc.code().name, exc.details())
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the control plane is unreachable; retry shortly")

    async def Generate(self, request: inference_pb2.GenerateRequest, context):
        arrived = time.perf_counter()
        request_id = request.request_id or current_request_id()
        request_id_var.set(request_id)  # the client's own id, when it chose one, names the request everywhere
        model = await self._lookup(context, self._directory.resolve_model, request.model)
        try:
            genrequest.check(request, model.max_model_len or None)
        except genrequest.RequestInvalid as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        forwarded = inference_pb2.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.model = model.name
        forwarded.request_id = request_id
        worker_request = worker_pb2.WorkerGenerateRequest(request=forwarded, request_id=request_id)

        remaining = context.time_remaining()
        timeout = min(remaining, self._max_stream_seconds) if remaining is not None else self._max_stream_seconds
        tried: set[WorkerId] = set()
        sent_any = False
        for attempt in range(self._retries + 1):
            candidates = await self._lookup(context, self._directory.candidates, model.name, tried)
            worker = self._picker.pick(candidates)
            tried.add(worker.worker_id)
            router_ms = (time.perf_counter() - arrived) * 1000
            call = self._workers.Generate(worker_request, timeout=timeout, metadata=((WORKER_HEADER, worker.address),))
            try:
                async for chunk in call:
                    if chunk.finish_reason:
                        chunk.timings.router_ms = router_ms
                        log.info(
                            "served by %s: %d prompt (%d cached) + %d completion tokens, %s, TTFT %.1f ms at the worker",
                            worker.worker_id, chunk.usage.prompt_tokens, chunk.usage.cached_tokens,
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
                await context.abort(code, exc.details() or f"worker {worker.worker_id} failed")
            finally:
                # A client that went away cancels this handler; take the worker's stream with it.
                call.cancel()

    async def ListModels(self, request: inference_pb2.ListModelsRequest, context) -> inference_pb2.ListModelsResponse:
        snap = await self._lookup(context, self._directory.snapshot)
        ready: dict[str, int] = {}
        for w in snap.workers:
            ready[w.model] = ready.get(w.model, 0) + 1
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(
                    name=m.name, version=m.version, ready_workers=ready.get(m.name, 0), max_model_len=m.max_model_len
                )
                for m in snap.models
            ]
        )
