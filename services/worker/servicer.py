"""gaas.v1.Worker: protobuf <-> engine, nothing more."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gaas import genrequest
from gaas.runtime.context import current_tenant
from gaas.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.engine import (
    ABORT,
    ERROR,
    LENGTH,
    STOP,
    Engine,
    EngineBusy,
    EngineFailed,
    EngineUnavailable,
    GenerationRequest,
    InvalidRequest,
)

log = logging.getLogger(__name__)

FINISH_TO_PB = {
    STOP: common_pb2.FINISH_REASON_STOP,
    LENGTH: common_pb2.FINISH_REASON_LENGTH,
    ABORT: common_pb2.FINISH_REASON_ABORT,
    ERROR: common_pb2.FINISH_REASON_ERROR,
}


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, engine: Engine | None = None) -> None:
        self._worker_id = worker_id
        # Set once the engine is up; until then calls get UNAVAILABLE.
        self.engine = engine

    async def _engine_or_abort(self, context) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading; retry shortly")
        return self.engine

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context):
        engine = await self._engine_or_abort(context)
        info = engine.info
        r = request.request
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if r.model and r.model != info.model:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"this worker serves {info.model!r}, not {r.model!r}"
            )
        try:
            max_tokens = genrequest.check(r, info.max_model_len)
            gen = GenerationRequest(
                request_id=request.request_id,
                prompt=r.prompt,
                prompt_token_ids=list(r.prompt_token_ids),
                max_tokens=max_tokens,
                messages=[(m.role, m.content) for m in r.messages],
                sampling=genrequest.sampling_dict(r.sampling),
                stop=list(r.stop),
                priority=genrequest.VLLM_PRIORITY[r.priority],
                cache_salt=request.cache_salt,
            )
        except genrequest.RequestInvalid as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        started = time.perf_counter()
        first_token_ms = 0.0
        produced = 0
        try:
            async for d in engine.generate(gen):
                chunk = common_pb2.GenerateChunk(request_id=request.request_id, text=d.text, token_ids=d.token_ids)
                if not first_token_ms and d.token_ids:
                    first_token_ms = (time.perf_counter() - started) * 1000
                produced = d.completion_tokens
                if d.finish_reason is not None:
                    chunk.finish_reason = FINISH_TO_PB[d.finish_reason]
                    chunk.stop_reason = d.stop_reason
                    chunk.usage.prompt_tokens = d.prompt_tokens
                    chunk.usage.cached_tokens = d.cached_tokens
                    chunk.usage.completion_tokens = d.completion_tokens
                    chunk.worker_id = self._worker_id
                    chunk.tenant = current_tenant()
                    chunk.model = info.model
                    chunk.model_version = info.model_version
                    chunk.timings.queue_ms = d.queue_ms
                    chunk.timings.ttft_ms = first_token_ms
                    chunk.timings.engine_ms = (time.perf_counter() - started) * 1000
                yield chunk
        except asyncio.CancelledError:
            log.info("cancelled by the caller after %d tokens; engine request aborted", produced)
            raise
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except EngineBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker {self._worker_id} is full: {exc}")
        except EngineFailed as exc:
            log.error("engine failed on request %s: %s", request.request_id, exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"the engine failed: {exc}")

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context) -> worker_pb2.WorkerLoad:
        load = (await self._engine_or_abort(context)).load()
        return worker_pb2.WorkerLoad(
            worker_id=self._worker_id,
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            device_memory_used=load.device_memory_used,
            device_memory_total=load.device_memory_total,
        )
