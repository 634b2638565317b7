"""gaas.v1.Worker: protobuf <-> engine, nothing more."""

from __future__ import annotations

import asyncio
import logging
import time

from gaas.contracts import errors, finish, genrequest, tasks
from gaas.model.tokenizer import template_tools
from gaas.runtime.context import current_tenant
from gaas.host.devices import CpuMonitor, DeviceSample, GpuMonitor
from gaas.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.engine import (
    AdapterRef, Delta, EmbeddingRequest, Engine, EngineBusy, EngineUnavailable, GenerationRequest,
)
from services.worker import toolcalls
from services.worker.kvevents import KVEventRelay

log = logging.getLogger(__name__)

# Most tokens a streamed chunk may gather (a caller asking for more gets this).
MAX_STREAM_INTERVAL = 64

def _capped(cached: int, cap: int | None) -> int:
    return cached if cap is None else min(cached, cap)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        worker_id: str,
        engine: Engine | None = None,
        monitor: CpuMonitor | GpuMonitor | None = None,
        relay: KVEventRelay | None = None,
        max_waiting: int = 0,
    ) -> None:
        self._worker_id = worker_id
        # Requests waiting for their first token, and how many may (0: any number).
        self._waiting = 0
        self._max_waiting = max_waiting
        # Set once the engine is up; until then calls get UNAVAILABLE.
        self.engine = engine
        # The device it computes on, and its engine's KV events (both set with the engine).
        self.monitor = monitor
        self.relay = relay
        # The device's last sample, kept fresh off the event loop (server.sample_device).
        self.device_sample: DeviceSample | None = None
        # Stopping: the streams end with UNAVAILABLE at their next token, and whoever is in each
        # carries it on at another worker (a router, or this worker's front end on the direct path:
        # gaas.contracts.continuation).
        self.handing_over = False

    @property
    def worker_id(self) -> str:
        return self._worker_id

    def _engine(self) -> Engine:
        if self.engine is None:
            raise EngineUnavailable("the engine is still loading; retry shortly")
        return self.engine

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context, on_abandoned=None):
        """The request's chunks. on_abandoned (a caller in this process that meters the request):
        told, with a future of the first chunk, when its caller leaves before that chunk (the engine
        runs the request on to it: Engine's GenerationRequest.on_abandoned). When this worker hands
        its streams over (it is stopping), the stream ends with UNAVAILABLE at its next token, and
        whoever is in it carries it on elsewhere."""
        engine = self._engine()
        info = engine.info
        r = request.request
        if not request.request_id:
            raise errors.InvalidArgument("request_id is required", param="request_id")
        if r.model and r.model != info.model:
            raise errors.FailedPrecondition(f"this worker serves {info.model!r}, not {errors.quote(r.model)}")
        if r.HasField("embed"):
            yield await self._embed(engine, request)
            return
        tasks.check(info.model, info.task, tasks.GENERATE)
        max_tokens = genrequest.check(r, info.max_model_len)
        tools = toolcalls.readers(r.tool_calling, lambda: engine.tool_parser(template_tools(r.tools) or []))
        sampling = genrequest.sampling_dict(r.sampling)
        if tools is not None and tools.adjusted is not None and not r.sampling.HasField("skip_special_tokens"):
            # (the tool parser reads calls whose tags may be special tokens: they stay in the text)
            sampling["skip_special_tokens"] = bool(getattr(tools.adjusted, "skip_special_tokens", True))
        gen = GenerationRequest(
            request_id=request.request_id,
            prompt=r.prompt,
            prompt_token_ids=list(r.prompt_token_ids),
            max_tokens=max_tokens,
            messages=[(m.role, m.content) for m in r.messages],
            sampling=sampling,
            stop=list(r.stop),
            structured=genrequest.structured_dict(r.structured_output),
            priority=engine_priority(request),
            cache_salt=request.cache_salt,
            n=r.n or 1,
            logprobs=r.logprobs if r.HasField("logprobs") else None,
            add_special_tokens=r.add_special_tokens if r.HasField("add_special_tokens") else not r.messages,
            add_generation_prompt=r.add_generation_prompt if r.HasField("add_generation_prompt") else True,
            continue_final_message=r.continue_final_message,
            stream_interval=min(request.stream_interval, MAX_STREAM_INTERVAL),
            adapter=(AdapterRef(request.adapter.name, request.adapter.adapter_id, request.adapter.path)
                     if request.HasField("adapter") else None),
            on_abandoned=None if on_abandoned is None else lambda delta: on_abandoned(self._chunk_later(
                request.request_id, delta, cap)),
        )
        # Under a public prefix's salt, a hit past the prefix would be another tenant's continuation.
        cap = request.cached_tokens_cap if request.HasField("cached_tokens_cap") else None
        self._check_room()
        started = time.perf_counter()
        first_token_ms = 0.0
        produced = 0
        self._waiting += 1
        waiting = True
        try:
            async for d in engine.generate(gen):
                if self.handing_over and not d.done:
                    log.info("handing request %s over after %d tokens: this worker is stopping",
                             request.request_id, produced)
                    raise EngineUnavailable("this worker is stopping; another worker carries the stream on")
                if not first_token_ms and d.token_ids:
                    first_token_ms = (time.perf_counter() - started) * 1000
                    self._waiting -= 1
                    waiting = False
                produced = d.completion_tokens
                chunk = self._chunk(request.request_id, d, cap)
                if tools is not None:
                    tools.rewrite(chunk)
                if d.done:
                    chunk.usage.prompt_tokens = d.prompt_tokens
                    chunk.usage.cached_tokens = _capped(d.cached_tokens, cap)
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
        finally:
            if waiting:
                self._waiting -= 1

    async def _embed(self, engine: Engine, request: worker_pb2.WorkerGenerateRequest) -> common_pb2.GenerateChunk:
        """An embeddings request's one chunk: a vector per input, the usage and the timings."""
        info, e = engine.info, request.request.embed
        tasks.check(info.model, info.task, tasks.EMBED)
        if not e.inputs:
            raise errors.InvalidArgument("an embeddings request needs at least one input", param="input")
        inputs: list[list[int] | str] = [list(i.token_ids) if i.token_ids else i.text for i in e.inputs]
        if not all(inputs):
            raise errors.InvalidArgument("every input needs text or token ids", param="input")
        if self.handing_over:
            raise EngineUnavailable("this worker is stopping; another worker may take the request")
        self._check_room()
        started = time.perf_counter()
        self._waiting += 1
        try:
            out = await engine.embed(EmbeddingRequest(
                request.request_id, inputs, e.dimensions if e.HasField("dimensions") else None,
                priority=engine_priority(request),
                cache_salt=request.cache_salt,
                add_special_tokens=e.add_special_tokens if e.HasField("add_special_tokens") else True))
        finally:
            self._waiting -= 1
        took_ms = (time.perf_counter() - started) * 1000
        chunk = common_pb2.GenerateChunk(request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_STOP,
                                         embeddings=out.vectors, worker_id=self._worker_id,
                                         tenant=current_tenant(), model=info.model, model_version=info.model_version)
        chunk.usage.prompt_tokens = out.prompt_tokens
        chunk.usage.cached_tokens = out.cached_tokens
        chunk.timings.ttft_ms = chunk.timings.engine_ms = took_ms
        return chunk

    def _check_room(self) -> None:
        """EngineBusy (untaken: another worker may serve it) while max_waiting requests wait on the
        engine (for their first token, or their vectors)."""
        if self._max_waiting and self._waiting >= self._max_waiting:
            raise EngineBusy(
                f"this worker's queue is full ({self._waiting} requests waiting for their first token or vectors); "
                "another worker, or a retry shortly, may serve it", reason="worker_busy", retry_after=1.0,
            )

    def _chunk_later(self, request_id: str, delta: "asyncio.Future[Delta | None]", cap: int | None) -> asyncio.Future:
        async def chunk() -> common_pb2.GenerateChunk | None:
            d = await delta
            return None if d is None else self._chunk(request_id, d, cap)

        return asyncio.ensure_future(chunk())

    @staticmethod
    def _chunk(request_id: str, d: Delta, cap: int | None = None) -> common_pb2.GenerateChunk:
        chunk = common_pb2.GenerateChunk(request_id=request_id, text=d.text, token_ids=d.token_ids, index=d.index)
        if d.first:
            chunk.prefill.prompt_tokens, chunk.prefill.cached_tokens = d.prompt_tokens, _capped(d.cached_tokens, cap)
        if d.finish_reason is not None:
            chunk.finish_reason = finish.TO_PB[d.finish_reason]
            chunk.stop_reason = d.stop_reason
        for lp in d.logprobs:
            entry = chunk.logprobs.add(token_id=lp.token_id, token=lp.token, logprob=lp.logprob)
            for token_id, token, logprob, rank in lp.top:
                entry.top.add(token_id=token_id, token=token, logprob=logprob, rank=rank)
        return chunk

    def load_report(self) -> common_pb2.WorkerLoad:
        """The worker's load now: the engine's counts and the device's state."""
        engine = self._engine()
        load = engine.load()
        report = common_pb2.WorkerLoad(
            worker_id=self._worker_id,
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            kv_cache_blocks=engine.info.kv_cache_blocks,
            reported_unix_ms=int(time.time() * 1000),
            adapters=load.adapters,
            adapter_slots=engine.info.adapter_slots,
            preemptions=load.preemptions,
        )
        sample = self.device_sample
        if self.monitor is not None and sample is not None:
            d = self.monitor.describe()
            report.device_memory_used, report.device_memory_total = sample.memory_used, sample.memory_total
            report.device_utilization = sample.utilization
            report.device.CopyFrom(common_pb2.DeviceInfo(
                kind=d.kind, name=d.name, memory_total=d.memory_total, uuid=d.uuid, pci_bus_id=d.pci_bus_id,
                nvlink_peers=d.nvlink_peers, cpu_cores=d.cpu_cores,
            ))
        return report

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context) -> common_pb2.WorkerLoad:
        return self.load_report()

    async def WatchKVEvents(self, request: worker_pb2.WatchKVEventsRequest, context):
        self._engine()
        if self.relay is None:
            raise errors.FailedPrecondition("this worker's engine publishes no KV events")
        log.info("a KV directory watches this worker (snapshot of %d blocks, then live events)", self.relay.blocks)
        async for batch in self.relay.watch():
            yield batch


def engine_priority(request: worker_pb2.WorkerGenerateRequest) -> int:
    """vLLM's priority for a request: the router's (from the tenant's tier and the client's), or
    the request class's default where the router gave none."""
    if request.HasField("engine_priority"):
        return request.engine_priority
    return genrequest.VLLM_PRIORITY[request.request.priority]
