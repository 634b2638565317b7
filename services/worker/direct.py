"""gaas.v1.OpenAI's generation and embeddings methods (served over the worker's HTTP front,
http.py) and gaas.v1.Inference's Generate (gRPC) on a worker, for requests the router decided at the
ingress (topology: ingress.path: direct; gaas/metering/direct.py): the body is a DirectGenerate the
router put there, never a client's. The worker generates (every prompt of a prompt list; a stream
its engine cannot finish carried on at another worker: carryon.py) or embeds, formats the OpenAI
answer (the native API's chunks go out as they come), commits a session turn's reply and appends
the usage event before the last chunk (gaas.sessions.turns, gaas.metering.meter, as the router
does on its own routes) and reports the request's end to the router that decided it
(gaas.metering.direct.report_channel)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.api import httpbody_pb2
from google.protobuf.message import DecodeError
from opentelemetry import trace
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.contracts import errors, jsonbody
from gaas.contracts.sessions import Context
from gaas.metering import direct
from gaas.openai import api as openai_api, embeddings as openai_embeddings, stream as openai_stream
from gaas.metering.admission import PROGRESS_HEARTBEAT_SECONDS, PROGRESS_SECONDS
from gaas.metering.meter import Meter, Metered, metered
from gaas.runtime.context import request_id_var, tenant_var
from gaas.runtime.status import translate
from gaas.runtime.streams import merge
from gaas.sessions import turns
from gaas.sessions.turns import TurnEnds
from gaas.contracts.services import GRPC_SERVICE, OPENAI_DIRECT_PATHS
from gaas.v1 import common_pb2, worker_pb2
from services.worker.carryon import CarryOn
from services.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)

# A DirectGenerate holds the client's body and its token ids: the router's limit and some.
MAX_BODY_BYTES = 64 << 20
# The native API's service (the router's own), whose Generate a worker serves on the direct path.
NATIVE_SERVICE = GRPC_SERVICE["router"]


class DirectServicer:
    def __init__(self, worker: WorkerServicer, meter: Meter | None, redis: Redis | None = None,
                 carry_on: CarryOn | None = None) -> None:
        self._worker = worker
        self._meter = meter
        # Where the routers hear of their requests' ends (gaas.metering.direct.report_channel), and
        # where a session turn's reply is committed.
        self._redis = redis
        self._turns = TurnEnds(redis) if redis is not None else None
        # How a stream outlives this worker's engine (carried on at another worker).
        self._carry_on = carry_on or CarryOn(worker, None)
        # What the streams left running: reports of their ends, turns given back.
        self._reports: set[asyncio.Task] = set()
        # The usage records of the streams running here, whose progress is written for the router
        # to bill from should this process die (run_progress).
        self._live: dict[str, Metered] = {}

    async def run_progress(self, every_s: float = PROGRESS_SECONDS) -> None:
        """Write what each running stream's client has been sent, every every_s, until cancelled
        (gaas.metering.admission's progress keys; nothing while no stream runs)."""
        sent: dict[str, int] = {}
        beat = time.monotonic()
        while True:
            await asyncio.sleep(every_s)
            # All of them once a heartbeat (the router takes a stream whose key goes unwritten
            # for its worker's death), else those that moved.
            everyone = time.monotonic() - beat >= PROGRESS_HEARTBEAT_SECONDS
            moved = [m for rid, m in self._live.items() if everyone or sent.get(rid) != m.relayed]
            sent = {rid: m.relayed for rid, m in self._live.items()}
            if everyone:
                beat = time.monotonic()
            if moved and self._meter is not None:
                await self._meter.write_progress(moved, self._worker.worker_id)

    def completions(self, request: httpbody_pb2.HttpBody) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """POST /v1/completions as the router decided it: the answer's pieces (the HTTP front
        writes them: services/worker/http.py)."""
        return self._serve(request, openai_api.parse_completion)

    def chat_completions(self, request: httpbody_pb2.HttpBody) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """POST /v1/chat/completions as the router decided it."""
        return self._serve(request, openai_api.parse_chat)

    def embeddings(self, request: httpbody_pb2.HttpBody) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """POST /v1/embeddings as the router decided it: the engine's one chunk of vectors,
        answered in vLLM's shape."""
        return self._embed(request)

    def http_routes(self) -> dict:
        """The HTTP front's routes: the paths the ingress sends them to (gaas.v1.OpenAI's methods)."""
        return dict(zip(OPENAI_DIRECT_PATHS, (self.completions, self.chat_completions, self.embeddings), strict=True))

    async def Generate(self, d: worker_pb2.DirectGenerate, context):
        """gaas.v1.Inference's Generate as a router decided it at the ingress: the native API's
        chunks as they come (the router's route sends them alike), metered here."""
        arrived, arrived_unix = time.perf_counter(), time.time()
        _check(d)
        if len(d.prompts) != 1:
            raise errors.InvalidArgument("the native API's Generate is one prompt")
        async for _, c in self._metered(d, context, arrived, arrived_unix):
            yield c

    async def _serve(self, http: httpbody_pb2.HttpBody, parse):
        arrived, arrived_unix = time.perf_counter(), time.time()
        d = _decided(http)
        parsed = parse(jsonbody.parse(d.openai_body, MAX_BODY_BYTES))
        fmt = openai_stream.Formatter(parsed, d.request_id, d.metering.adapter or d.metering.model)
        usage = openai_stream.Usage(prompt=d.metering.prompt_tokens, explain=d.explain)
        async for body in openai_stream.respond(parsed, fmt, usage, self._metered(d, None, arrived, arrived_unix),
                                                d.session.truncation):
            yield body

    async def _embed(self, http: httpbody_pb2.HttpBody):
        arrived, arrived_unix = time.perf_counter(), time.time()
        d = _decided(http)
        parsed = openai_embeddings.parse_embedding(jsonbody.parse(d.openai_body, MAX_BODY_BYTES))
        last = None
        async for _, last in self._metered(d, None, arrived, arrived_unix):
            pass
        if last is None or len(last.embeddings) != len(parsed.inputs):
            raise errors.Internal(errors.internal_message(d.request_id))
        answer = openai_embeddings.embeddings_json(d.request_id,
                                                   d.metering.adapter or d.metering.model, last.embeddings,
                                                   last.usage.prompt_tokens, parsed.encoding_format)
        for piece in openai_stream.answer_pieces(answer):
            yield piece

    def _metered(self, d: worker_pb2.DirectGenerate, context, arrived: float, arrived_unix: float):
        """(which prompt, chunk) of the generation, its usage event appended before its last chunk
        goes out (a session turn's reply committed before that) and its end then reported to the
        router that decided it."""
        request_id_var.set(d.request_id)
        tenant_var.set(d.metering.tenant)
        record = direct.metered(d, direct.arrived_at(d, arrived, arrived_unix)) if self._meter is not None else None
        # A client gone before the first token leaves the request running to it, and billed.
        abandoned = None if record is None else record.abandoned.append
        turn = self._turn(d)

        async def prompt(r: worker_pb2.WorkerGenerateRequest):
            async for c in self._carry_on.stream(r, list(d.carry_on), context, on_abandoned=abandoned):
                if c.HasField("usage"):
                    direct.complete(c.timings, d, arrived_unix)
                    c.tenant = d.metering.tenant
                    # The request's trace (the ingress's, which the worker's server span joined).
                    span = trace.get_current_span()
                    if span.is_recording():
                        c.timings.trace_id = format(span.get_span_context().trace_id, "032x")
                yield c

        streams = [prompt(r) for r in d.prompts]
        if turn is not None:
            streams = [self._committing(turn, streams[0], d.session.ttl_seconds * 1000)]
        finals: list[common_pb2.GenerateChunk] = []

        def ended(c) -> None:
            # metered() calls this with each prompt's final chunk, the last once the usage event is
            # written (its time is in the decomposition).
            finals.append(c)
            if len(finals) == len(d.prompts):
                reply, at = ("".join(turn.reply), turn.committed_ms) if turn is not None and c.HasField("session") \
                    else ("", 0)
                self._report(d, direct.report(c, finals, reply, at, d.request_id))

        return self._watched(d, record, finals, metered(self._meter, record, merge(streams), chunk_of=lambda p: p[1],
                                                        on_last=ended))

    async def _watched(self, d: worker_pb2.DirectGenerate, record: Metered | None, finals: list, items):
        """items, with record among the streams whose progress is written while they run, and an
        end other than served reported to the router (a served one is, by ended(), once its
        usage is written): failed, untaken (nothing yielded), or its client gone."""
        if record is not None:
            self._live[record.request_id] = record
        sent = False
        failure = None
        try:
            async for item in items:
                sent = True
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            failure = ("CANCELLED", "", False)
            raise
        except Exception as exc:
            err = translate(exc)
            failure = (err.code, err.message, err.untaken and not sent) if err is not None else \
                ("INTERNAL", type(exc).__name__, False)
            raise
        finally:
            if record is not None:
                self._live.pop(record.request_id, None)
            if failure is not None and len(finals) < len(d.prompts):
                self._report(d, direct.failure(d.request_id, self._worker.worker_id, *failure))
            await items.aclose()

    def _turn(self, d: worker_pb2.DirectGenerate) -> "_Turn | None":
        """The session turn a request is, as the router began it (None: it is none)."""
        s = d.session
        if not s.session_id:
            return None
        if self._turns is None:
            raise errors.Unavailable("this worker cannot reach the sessions' store (it has no Redis); another "
                                     "worker may serve the turn")
        return _Turn(tenant=d.metering.tenant, session_id=s.session_id, request_id=d.request_id, version=s.version,
                     context=Context.from_json(s.context), new=[(m.role, m.content) for m in s.new],
                     keep_from=s.keep_from)

    async def _committing(self, turn: "_Turn", chunks, ttl_ms: int):
        """The turn's chunks, its reply committed before the last (gaas.sessions.turns.committing);
        a turn that ends otherwise given back at once (the router that holds it would give it back
        only once the stream's end has gone unreported)."""
        try:
            async for c in turns.committing(turn, chunks, lambda ctx: self._commit(turn, ctx, ttl_ms),
                                            self._turns.now_ms):
                yield c
        finally:
            if not turn.committed_ms:
                self._background(self._turns.release(turn))

    async def _commit(self, turn: "_Turn", context: Context, ttl_ms: int) -> int:
        try:
            version = await self._turns.commit(turn, context, ttl_ms)
        except RedisError as exc:
            log.warning("cannot commit a turn of session %s (%s)", turn.session_id, exc)
            raise turns.unavailable() from None
        turn.committed_ms = context.updated_ms
        return version

    def _background(self, coro) -> None:
        """Run coro to its end whatever happens to the stream that started it."""
        task = asyncio.create_task(coro)
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _report(self, d: worker_pb2.DirectGenerate, summary: str) -> None:
        """Publish the report of d's end on the channel of the router that decided it."""
        if self._redis is not None and d.router:
            self._background(self._publish(d.router, summary))

    async def _publish(self, router: str, summary: str) -> None:
        """Until the router hears it (Redis says a subscriber got it: a Redis restarting, or the
        router reconnecting, loses what is published meanwhile), for REPORT_SECONDS at most; then
        the router's sweep finds the request's end from its progress."""
        deadline, failed = time.monotonic() + direct.REPORT_SECONDS, None
        while time.monotonic() < deadline:
            try:
                if await self._redis.publish(direct.report_channel(router), summary):
                    return
            except RedisError as exc:
                failed = exc
            await asyncio.sleep(0.25)
        log.warning("no report of a request's end reached %s in %.0f s (%s)", router, direct.REPORT_SECONDS,
                    failed or "nobody listens on its channel")


@dataclass(slots=True)
class _Turn(turns.OpenTurn):
    """A session turn this worker streams; when its reply was committed (Unix ms, 0: not yet)."""

    committed_ms: int = 0


def _decided(http: httpbody_pb2.HttpBody) -> worker_pb2.DirectGenerate:
    """The DirectGenerate the router put in an OpenAI request's body at the ingress."""
    if http.content_type != direct.CONTENT_TYPE:
        raise errors.FailedPrecondition("a worker serves OpenAI requests only as a router decided them at the ingress")
    try:
        d = worker_pb2.DirectGenerate.FromString(http.data)
    except DecodeError:
        raise errors.InvalidArgument("the request is not a DirectGenerate") from None
    _check(d)
    return d


def _check(d: worker_pb2.DirectGenerate) -> None:
    if not d.request_id or not d.metering.tenant or not d.prompts:
        raise errors.FailedPrecondition("a worker serves a generation at the ingress only as a router decided it")


def add_native_to_server(servicer: DirectServicer, server) -> None:
    """gaas.v1.Inference's Generate on a worker, whose request is the DirectGenerate the router put
    in the body at the ingress (never a client's GenerateRequest: the worker's sidecar lets only the
    ingress call it, and the ingress sends it here only as the router named this worker)."""
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=worker_pb2.DirectGenerate.FromString,
        response_serializer=common_pb2.GenerateChunk.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(NATIVE_SERVICE, {"Generate": handler}),))
