"""Shadow traffic: while a model's new version shadows (gaas.contracts.rollout, Strategy.SHADOW), a
share of the requests its stable version serves is copied to it. A copy is prepared for the new
version (its tokenizer, its window), placed by the scheduler on one of its workers, read to its end
and thrown away; its outcome (TTFT from when it was sent, tokens per second, failure) goes to the
guard marked as a shadow's. Nobody is billed for it and no tenant's quota counts it: it is never
admitted and no usage event is made for it. The client's request does not wait for it: a copy that
finds no room (its version has no worker with room, or too many copies are running) is dropped."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gaas.contracts import errors
from gaas.contracts.principal import Principal
from gaas.runtime.context import WORKER_HEADER
from gaas.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from services.router.directory import MeshDirectory, ModelEntry
from services.router.outcomes import Outcomes
from services.router.prepare import Preparer
from services.router.scheduling import RequestContext, Scheduler
from services.router.versions import VersionChooser

log = logging.getLogger(__name__)

# Copies running at once, at most; how long one may run; tokens per streamed message of a copy
# (its first token still comes at once: TTFT is measured; the rest in few, full messages, so the
# copy costs the mesh's front ends little per token).
MAX_COPIES = 32
COPY_SECONDS = 300.0
COPY_STREAM_INTERVAL = 64


class Shadow:
    def __init__(self, preparer: Preparer, directory: MeshDirectory, scheduler: Scheduler,
                 workers: worker_pb2_grpc.WorkerStub, outcomes: Outcomes, max_copies: int = MAX_COPIES) -> None:
        self._preparer = preparer
        self._directory = directory
        self._scheduler = scheduler
        self._workers = workers
        self._outcomes = outcomes
        self._chooser = VersionChooser()
        self._max = max_copies
        self._running: set[asyncio.Task] = set()
        self.copies = 0
        self.dropped = 0
        self._said_drop = 0.0

    def maybe_copy(self, request: inference_pb2.GenerateRequest, principal: Principal, served_by: ModelEntry,
                   request_id: str) -> None:
        """A request its model's stable version serves: copied to the shadowing version for its share."""
        split = served_by.split
        if split is None or not split.shadow or served_by.version != split.stable or not split.canary:
            return
        if not self._chooser.shadow(split, principal.tenant):
            return
        if len(self._running) >= self._max:
            self.dropped += 1
            return
        task = asyncio.create_task(self._copy(request, principal, served_by, split.canary, request_id),
                                   name=f"shadow {request_id}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _copy(self, request: inference_pb2.GenerateRequest, principal: Principal, served_by: ModelEntry,
                    version: str, request_id: str) -> None:
        canary = served_by.at(version)
        ok, ttft_ms, tokens, decode_s = False, None, 0, 0.0
        try:
            prepared = await self._preparer.prepare_at(request, principal, canary)
            workers = await self._directory.workers(canary.name, canary.version)
            ctx = RequestContext(model=canary.name, tenant=principal.tenant, tier=principal.tier,
                                 prompt_tokens=prepared.prompt_tokens, max_tokens=prepared.request.max_tokens)
            worker = self._scheduler.schedule(ctx, workers).worker
        except (errors.GaasError, LookupError) as exc:
            self.dropped += 1
            now = time.monotonic()
            if now - self._said_drop > 30:
                self._said_drop = now
                log.info("shadow copies of %s to %s are dropped (%d so far): %s", canary.name, version, self.dropped,
                         exc)
            return
        self.copies += 1
        sent = time.perf_counter()
        first = last = None
        call = self._workers.Generate(
            worker_pb2.WorkerGenerateRequest(request=prepared.request, request_id=f"shadow-{request_id}",
                                             cache_salt=prepared.cache_salt, stream_interval=COPY_STREAM_INTERVAL),
            timeout=COPY_SECONDS, metadata=((WORKER_HEADER, worker.address),))
        try:
            async for chunk in call:
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
                if chunk.HasField("usage"):
                    last, tokens = time.perf_counter(), chunk.usage.completion_tokens
            ok = True
        except grpc.aio.AioRpcError as exc:
            log.info("shadow copy of %s failed at %s (%s %s)", request_id, worker.worker_id, exc.code().name,
                     exc.details())
        except asyncio.CancelledError:
            call.cancel()
            raise
        if first is not None:
            ttft_ms = (first - sent) * 1000
            decode_s = (last - first) if last is not None else 0.0
        self._outcomes.rollout(canary, principal.tier, ok, ttft_ms, tokens, decode_s, shadow=True)

    async def close(self) -> None:
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
