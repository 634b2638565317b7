"""gaas.v1.OpenAI's generation methods and gaas.v1.Inference's Generate on a worker, for requests
the router decided at the ingress (topology: ingress.path: direct; gaas/metering/direct.py): the
body is a DirectGenerate the router put there, never a client's. The worker generates, formats the
OpenAI answer (the native API's chunks go out as they come), appends the usage event before the
last chunk (gaas.metering.meter, as the router does on its own routes) and reports the request's
end to the router that decided it (gaas.metering.direct.report_channel)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.api import httpbody_pb2
from google.protobuf.message import DecodeError
from opentelemetry import trace
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.contracts import errors, jsonbody
from gaas.metering import direct
from gaas.openai import api as openai_api, stream as openai_stream
from gaas.metering.meter import Meter, metered
from gaas.runtime.context import request_id_var, tenant_var
from gaas.contracts.services import GRPC_SERVICE
from gaas.v1 import common_pb2, openai_pb2_grpc, worker_pb2
from services.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)

# A DirectGenerate holds the client's body and its token ids: the router's limit and some.
MAX_BODY_BYTES = 64 << 20
# The native API's service (the router's own), whose Generate a worker serves on the direct path.
NATIVE_SERVICE = GRPC_SERVICE["router"]


class DirectServicer(openai_pb2_grpc.OpenAIServicer):
    def __init__(self, worker: WorkerServicer, meter: Meter | None, redis: Redis | None = None) -> None:
        self._worker = worker
        self._meter = meter
        # Where the routers hear of their requests' ends (gaas.metering.direct.report_channel).
        self._redis = redis
        self._reports: set[asyncio.Task] = set()

    async def Completions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, openai_api.parse_completion):
            yield body

    async def ChatCompletions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, openai_api.parse_chat):
            yield body

    async def Generate(self, d: worker_pb2.DirectGenerate, context):
        """gaas.v1.Inference's Generate as a router decided it at the ingress: the native API's
        chunks as they come (the router's route sends them alike), metered here."""
        arrived, arrived_unix = time.perf_counter(), time.time()
        if not d.generate.request_id or not d.metering.tenant:
            raise errors.FailedPrecondition("a worker serves the native API only as a router decided it at the ingress")
        async for _, c in self._metered(d, context, arrived, arrived_unix):
            yield c

    async def _serve(self, http: httpbody_pb2.HttpBody, context, parse):
        arrived, arrived_unix = time.perf_counter(), time.time()
        if http.content_type != direct.CONTENT_TYPE:
            raise errors.FailedPrecondition("a worker serves OpenAI requests only as a router decided them at the ingress")
        try:
            d = worker_pb2.DirectGenerate.FromString(http.data)
        except DecodeError:
            raise errors.InvalidArgument("the request is not a DirectGenerate") from None
        parsed = parse(jsonbody.parse(d.openai_body, MAX_BODY_BYTES))
        fmt = openai_api.Formatter(parsed, d.generate.request_id, d.metering.model)
        usage = openai_stream.Usage(prompt=d.metering.prompt_tokens, explain=d.explain)
        async for body in openai_stream.respond(parsed, fmt, usage, self._metered(d, context, arrived, arrived_unix)):
            yield body

    def _metered(self, d: worker_pb2.DirectGenerate, context, arrived: float, arrived_unix: float):
        """(0, chunk) of the generation, its usage event appended before its last chunk goes out
        and its end then reported to the router that decided it."""
        request_id_var.set(d.generate.request_id)
        tenant_var.set(d.metering.tenant)
        record = direct.metered(d, direct.arrived_at(d, arrived, arrived_unix)) if self._meter is not None else None

        async def chunks():
            # A client gone before the first token leaves the request running to it, and billed.
            abandoned = None if record is None else record.abandoned.append
            async for c in self._worker.Generate(d.generate, context, on_abandoned=abandoned, handed_over=False):
                if c.HasField("usage"):
                    direct.complete(c.timings, d, arrived_unix)
                    c.tenant = d.metering.tenant
                    # The request's trace (the ingress's, which the worker's server span joined).
                    span = trace.get_current_span()
                    if span.is_recording():
                        c.timings.trace_id = format(span.get_span_context().trace_id, "032x")
                yield 0, c

        def summary(c) -> None:
            # metered() calls this once the usage event is written (its time is in the decomposition).
            if self._redis is not None and d.router:
                task = asyncio.create_task(self._report(d.router, direct.final_summary(c)))
                self._reports.add(task)
                task.add_done_callback(self._reports.discard)

        return metered(self._meter, record, chunks(), chunk_of=lambda p: p[1], on_last=summary)

    async def _report(self, router: str, summary: str) -> None:
        try:
            await self._redis.publish(direct.report_channel(router), summary)
        except RedisError as exc:  # the router ends the request unknown after a grace period
            log.warning("cannot report a request's end to %s (%s)", router, exc)


def add_native_to_server(servicer: DirectServicer, server) -> None:
    """gaas.v1.Inference's Generate on a worker, whose request is the DirectGenerate the router put
    in the body at the ingress (never a client's GenerateRequest: the worker's sidecar lets only the
    ingress call it, and the ingress sends it here only as the router named this worker)."""
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=worker_pb2.DirectGenerate.FromString,
        response_serializer=common_pb2.GenerateChunk.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(NATIVE_SERVICE, {"Generate": handler}),))
