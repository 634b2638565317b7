"""The router's decision at the ingress, with the router out of the token stream (topology:
ingress.path: direct), the way the Gateway API Inference Extension's endpoint picker works:
Envoy's external processing protocol (envoy.service.ext_proc.v3; the part of it used here is
protos/gaas/v1/ext_proc.proto), its calls served over HTTP/1.1 from the router's sidecar
(extproc_http.py), its messages' shapes in extproc_wire.py.

For each generation (both OpenAI routes and the native API's Generate), the ingress sends the
request's headers and its body here (an OpenAI route's HTTP request before the transcoder, its
JSON; the rest transcoded, gRPC). The router authenticates, admits and places it as
it does for its own routes, then answers with the worker to send it to (x-gaas-worker, which picks
the ingress's cluster of that worker's sidecar) and the body replaced by a gaas.v1.DirectGenerate:
the tokens then stream from the worker to the ingress without passing through the router, and the
worker formats and meters the answer. The router's call ends with its answer (nothing of the
response comes back to it: a router that dies then cuts no stream). The worker reports the
request's end to this router (gaas/metering/direct.py), which then records it as one of its own
streams (metrics, windows, circuit breakers) and frees its room; a request no worker serves any
more (its progress key goes unwritten) the sweep finds, and bills from that progress.

Every generation takes this path: a session's turn too (the router takes the turn and renews its
hold until the worker's report; the worker commits the reply) and a completion's prompt list (all
its prompts on the one worker placed). A refusal answers the client at once, in the shape the router's own route
would: to an HTTP client (an OpenAI route, or the native API's JSON) the HTTP status and the gRPC
status as JSON, which the ingress's error filter turns into OpenAI's error JSON; to a gRPC client a
trailers-only response with the status and its details.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from google.api import httpbody_pb2
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gaas.metering import admission, direct as direct_contract
from gaas.contracts import edge, jsonbody
from gaas.openai import api as openai_api, embeddings as openai_embeddings
from gaas.metering.meter import Metered
from gaas.openai.stream import EXPLAIN_HEADER
from gaas.runtime import redisconn, status
from gaas.runtime.context import REQUEST_ID_HEADER, TENANT_HEADER, WORKER_HEADER, begin_request, client_request_id_var
from gaas.contracts.services import GRPC_SERVICE, OPENAI_DIRECT_HTTP, OPENAI_SERVICE
from gaas.v1 import ext_proc_pb2 as ep
from gaas.v1 import inference_pb2, worker_pb2
from services.router.extproc_wire import TRANSCODED_HEADER, grpc_frame, header, headers_of, immediate, \
    immediate_grpc, message_of, passed_on, too_large
from services.router.placement import DirectPlacement
from services.router.openai_servicer import answer_check, engine_requests, session_id_of
from services.router.pipeline import Generation, Pipeline, Timing, note_client_id
from services.router.prepare import ScalingUp
from services.router.sessions import Held

log = logging.getLogger(__name__)

# How often the requests no report ended are looked for (sweep).
SWEEP_SECONDS = 1.0

# The OpenAI routes the ingress asks the router about, and how their bodies parse: by their gRPC
# paths (a gRPC client's request, its body one framed HttpBody), and by their HTTP paths (an HTTP
# client's, asked about before the transcoder: its body the JSON itself).
PARSERS = {
    f"/{OPENAI_SERVICE}/Completions": (openai_api.parse_completion, False),
    f"/{OPENAI_SERVICE}/ChatCompletions": (openai_api.parse_chat, True),
    f"/{OPENAI_SERVICE}/Embeddings": (openai_embeddings.parse_embedding, False),
}
HTTP_PARSERS = dict(zip(OPENAI_DIRECT_HTTP, PARSERS.values(), strict=True))
# The native API's generation, whose body is the GenerateRequest itself (gaas.contracts.services.DIRECT_GENERATION).
NATIVE_GENERATE = f"/{GRPC_SERVICE['router']}/Generate"


def http_path(headers: dict[str, str]) -> str:
    """The OpenAI HTTP path of a request asked about before the transcoder (its query left out), or ""."""
    path = headers.get(":path", "").partition("?")[0]
    return path if path in HTTP_PARSERS else ""



class ExternalProcessor:
    def __init__(self, pipeline: Pipeline, max_body_bytes: int, instance: str = "", moves: int = 0,
                 max_stream_s: float = 3600.0) -> None:
        self._pipeline = pipeline
        # Past this, a request no report ended is given up (the longest a stream may run, and some).
        self._max_stream_s = max_stream_s + admission.PROGRESS_STALE_SECONDS
        # Times a stream may be carried on at another worker (the workers it may move to are listed).
        self._moves = moves
        self._max_body = max_body_bytes
        self._meter = pipeline.meter
        # This router's name: the workers report its requests' ends on its channel.
        self._instance = instance
        # Requests sent straight to a worker and not yet reported ended, by request id.
        self._pending: dict[str, _Pending] = {}
        # Whether this router hears the workers' reports now (run_reports).
        self._hearing = True

    @property
    def pending(self) -> int:
        return len(self._pending)

    def reported(self, summary: str) -> None:
        """A worker's report of a request's end (gaas.metering.direct.report_channel): served, or
        failed, or its client gone; or refused untaken (then, if the worker was the router's pick
        and it named a second choice, the ingress sent the request there, whose report ends it)."""
        report = direct_contract.read_report(summary)
        if report is None:
            log.warning("a worker's report of a request's end is unreadable; ignored")
            return
        final = report.final
        entry = self._pending.get(final.request_id)
        if entry is None:
            return
        p = entry.placement
        if report.code and report.untaken and final.worker_id == p.worker.worker_id and p.fallback is not None:
            return
        del self._pending[final.request_id]
        if report.code == "CANCELLED":
            p.ended(None)
        elif report.code:
            p.ended(grpc.StatusCode[report.code] if report.code in grpc.StatusCode.__members__ else
                    grpc.StatusCode.UNKNOWN, report.detail, by=final.worker_id)
        else:
            p.ended(grpc.StatusCode.OK, "", final)
        # The worker settled the request's usage (its record, or its reservation given back).
        self._end(entry.metered, release=False,
                  used_tokens=None if report.code else final.usage.prompt_tokens + final.usage.completion_tokens)
        if entry.turn is not None:
            if not report.code and final.HasField("session") and report.session_committed_ms:
                # The worker committed the reply: this router's copy becomes what the session holds.
                turn = entry.turn
                turn.reply[:] = [report.session_reply]
                self._pipeline.sessions.committed(turn, final.session.version,
                                                  turn.extended(final, report.session_committed_ms))
            else:
                self._pipeline.sessions.release_later(entry.turn)

    def _end(self, metered: Metered | None, release: bool, used_tokens: int | None = None) -> None:
        """A request of this router's is over at its worker: out of this router's own count (with
        the tokens it used, when its report says), and its reservation given back when the worker
        recorded nothing for it (release)."""
        if metered is None or self._meter is None:
            return
        if release:
            self._meter.release_later(metered)  # (out of the count too)
        else:
            self._meter.ended(metered, used_tokens)

    def _unheard(self, metered: Metered | None) -> None:
        """While this router cannot hear the workers' reports (Redis away), it cannot tell when its
        direct requests end: they are out of its own count at once (else each would hold its
        tenant's place until Redis is back, and the tenant be refused as too many at once); Redis's
        count, once it answers, still bounds them. Their usage is still settled by their report
        (the workers publish each until it is heard) or by the sweep."""
        self._end(metered, release=False)

    def _lost(self, request_id: str) -> None:
        """A request whose end no worker will report (its worker's front end died, or no worker
        ever got it): its room goes back now, and its usage is settled: billed for what the
        worker's last progress says the client was sent, should the worker not have billed it,
        else its reservation given back (gaas.metering.admission: whichever records it, it is
        billed once); and its session's turn (a turn the worker committed is not this request's
        any more: nothing changes)."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        entry.placement.ended(None)
        if entry.metered is not None and self._meter is not None:
            self._meter.claim_later(entry.metered)
        if entry.turn is not None:
            self._pipeline.sessions.release_later(entry.turn)

    async def sweep(self, redis: Redis | None, every_s: float = SWEEP_SECONDS) -> None:
        """Find, until cancelled, the requests whose end no report will tell: those whose progress
        key no worker has written for admission.PROGRESS_STALE_SECONDS (their worker's process
        died with them in flight, or no worker ever started them), those its worker billed whose
        report was lost (with Redis), and those older than the longest a stream may run."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self._sweep_once(redis)
            except Exception:  # noqa: BLE001 - the next sweep tries again
                log.exception("sweeping this router's direct requests failed")

    async def _sweep_once(self, redis: Redis | None) -> None:
        now = time.monotonic()
        stale = admission.PROGRESS_STALE_SECONDS
        due = [(rid, e) for rid, e in self._pending.items() if now - e.decided > stale]
        if not due:
            return
        found: list = [None, -2] * len(due)
        if redis is not None:
            pipe = redis.pipeline(transaction=False)
            for rid, e in due:
                key = admission.progress_key(e.placement.principal.tenant, rid)
                pipe.get(key)
                pipe.pttl(key)
            try:
                found = await pipe.execute()
            except RedisError:
                found = [None, -2] * len(due)  # (Redis away: only age tells, this time)
        for i, (rid, e) in enumerate(due):
            value, age = found[2 * i], admission.progress_age(found[2 * i + 1])
            if now - e.decided > self._max_stream_s:
                why = "it outlived the longest a stream may run"
            elif admission.is_billed(value):
                why = "its worker billed it, and its report was lost"
            elif value is None or age is None or age <= stale:
                continue  # streaming; or no key to go by (Redis away at its admission): its age will tell
            elif admission.progress_worker(value):
                why = f"its worker {admission.progress_worker(value)} has not written its progress for {age:.0f} s"
            else:
                why = f"no worker started it within {age:.0f} s"
            log.warning("request %s ended unreported: %s", rid, why)
            self._lost(rid)

    async def run_reports(self, redis_url: str) -> None:
        """Hear the workers' reports of this router's requests' ends, until cancelled (reconnecting
        to Redis when it goes away, at once: the workers publish each report until it is heard)."""
        channel = direct_contract.report_channel(self._instance)
        failing = False
        while True:
            client = redisconn.connect(redis_url, timeout=None)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(channel)
                    self._hearing = True
                    if failing:
                        log.info("hearing the workers' reports again on %s", channel)
                        failing = False
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.reported(message["data"])
            except (RedisError, OSError) as exc:
                if not failing:
                    log.warning("cannot hear the workers' reports on %s (%s); retrying, and meanwhile its direct "
                                "requests hold no place in this router's own count", channel, exc)
                self._hearing = False
                for entry in self._pending.values():
                    self._unheard(entry.metered)
                failing = True
                await asyncio.sleep(0.25)
            finally:
                await client.aclose()

    async def process(self, requests):
        """One decision call: the ingress's ProcessingRequest messages (its request's headers, then
        its body) in, the ProcessingResponses that answer them out (extproc_http.py serves it)."""
        headers: dict[str, str] = {}
        body = bytearray()
        timing = Timing()
        principal = None
        # An OpenAI route's HTTP request (asked about before the transcoder): its body is the JSON.
        json_body = False
        async for req in requests:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                headers = headers_of(req.request_headers.headers)
                if req.request_headers.end_of_stream:  # no body: nothing to decide
                    yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                    return
                # The key is checked on the headers, before the body is read: these routes have no
                # key check of their own at the ingress (one call to a router per generation).
                try:
                    principal = await self._caller(headers, timing)
                except Exception as exc:  # noqa: BLE001 - every failure is answered, in the client's shape
                    yield self._refusal(exc, headers)
                    return
                json_body = bool(http_path(headers))
                if json_body and int(headers.get("content-length") or 0) > self._max_body + edge.FRAMING_BYTES:
                    yield too_large()
                    return
            elif kind == "request_body":
                body += req.request_body.body
                if json_body and len(body) > self._max_body + edge.FRAMING_BYTES:
                    yield too_large()
                    return
                if req.request_body.end_of_stream:
                    break
        else:
            return  # the client went away before its body was complete
        if principal is None:
            return  # (a body without headers: not what Envoy sends)
        native = headers.get(":path", "") == NATIVE_GENERATE
        # The ingress is not held on a decision long (services/router/holding.py): a request for an
        # autoscaled model none of whose workers serves yet is passed on to the router's own route
        # and waits there (ScalingUp).
        try:
            decided = await (self._decide_native(principal, headers, bytes(body), timing) if native
                             else self._decide(principal, headers, bytes(body), timing))
        except ScalingUp:
            decided = None
        except Exception as exc:  # noqa: BLE001 - every failure is answered, in the client's shape
            yield self._refusal(exc, headers)
            return
        if decided is None:
            for r in passed_on(bytes(body)):
                yield r
            return
        direct, p, g = decided.direct, decided.placement, decided.generation
        message = direct.SerializeToString()
        set_headers = [header(WORKER_HEADER, p.addresses), header(REQUEST_ID_HEADER, direct.request_id),
                       header(TENANT_HEADER, p.principal.tenant)]
        if json_body:
            # The transcoder makes the worker's request of it: an HttpBody of this content type, framed.
            set_headers.append(header("content-type", direct_contract.CONTENT_TYPE))
        elif native:
            message = grpc_frame(message)
        else:
            message = grpc_frame(httpbody_pb2.HttpBody(content_type=direct_contract.CONTENT_TYPE,
                                                       data=message).SerializeToString())
        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=set_headers), clear_route_cache=True)))
        yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=message, end_of_stream=True)))))
        self._pending[direct.request_id] = _Pending(p, g.metered, g.plan.held if g.plan is not None else None,
                                                    time.monotonic())
        if not self._hearing:
            self._unheard(g.metered)
        # The decision is all: this call ends here (cleanly, so the ingress goes on without the
        # router), and the router hears of the request's end from its worker's report.

    @staticmethod
    def _refusal(exc: Exception, headers: dict[str, str]) -> ep.ProcessingResponse:
        """The client's answer to a request refused for exc, in its shape (re-raised when exc is
        not an answer: a bug)."""
        if (err := status.answer_in_stream(exc)) is None:
            raise exc
        native = headers.get(":path", "") == NATIVE_GENERATE
        return immediate_grpc(err) if native and TRANSCODED_HEADER not in headers else immediate(err)

    async def _decide(self, principal, headers: dict[str, str], body: bytes, timing: Timing) -> Decided | None:
        """The request decided for its worker; None: the router's own route serves it (a path this
        router does not decide)."""
        if path := http_path(headers):
            (parse, chat), data = HTTP_PARSERS[path], body
        else:
            parse, chat = PARSERS.get(headers.get(":path", ""), (None, False))
            if parse is None:
                return None
            data = message_of(httpbody_pb2.HttpBody, body).data
        client_id = client_request_id_var.get()
        parsed = parse(jsonbody.parse(data, self._max_body))
        if isinstance(parsed, openai_embeddings.EmbeddingRequest):
            return await self._placed(principal, [openai_embeddings.engine_request(parsed)], timing, headers,
                                      client_id or parsed.client_request_id, parsed.client_request_id, data)
        session_id_of(parsed, headers)  # (on the engine requests: the pipeline reads it there)
        return await self._placed(principal, engine_requests(parsed), timing, headers,
                                  client_id or parsed.client_request_id, parsed.client_request_id, data, chat,
                                  check=answer_check(parsed))

    async def _decide_native(self, principal, headers: dict[str, str], body: bytes, timing: Timing) -> Decided:
        """_decide for the native API's Generate, whose body is the GenerateRequest."""
        client_id = client_request_id_var.get()
        request = message_of(inference_pb2.GenerateRequest, body)
        return await self._placed(principal, [request], timing, headers, client_id or request.request_id,
                                  request.request_id)

    async def _caller(self, headers: dict[str, str], timing: Timing):
        """Who calls, by the headers of the request this stream decides (its first message): its
        key, an unknown one counted against the client's address as the ingress decided it
        (services/router/edgeauth.py). Begins the request's context (its ids)."""
        begin_request(headers, edge=True)
        return await self._pipeline.authenticate(timing, headers.get(edge.CLIENT_ADDRESS_HEADER, ""))

    async def _placed(self, principal, requests, timing: Timing, headers: dict[str, str], client_id: str,
                      body_client_id: str, body: bytes = b"", chat: bool = False, check=None) -> Decided:
        """A request admitted and placed. body_client_id: the client's id for its request as its
        body named it (for the logs)."""
        note_client_id(body_client_id)
        g = await self._pipeline.start(principal, requests, timing, check=check, direct=True)
        p = await self._pipeline.place_direct(g)
        return Decided(self._direct(g, p, body, chat, headers, client_id), p, g)

    def _direct(self, g: Generation, p: DirectPlacement, body: bytes, chat: bool, headers: dict[str, str],
                client_id: str) -> worker_pb2.DirectGenerate:
        """What the ingress sends the worker: the placed request with the OpenAI body it formats the
        answer for, what the worker meters it with, a session turn's part, and where its stream
        is carried on should the worker's engine stop."""
        principal, timing, metered = g.principal, g.timing, g.metered
        model = g.prepared[0].model
        direct = worker_pb2.DirectGenerate(
            prompts=p.prompts, openai_body=body, chat=chat, request_id=g.request_id,
            ingress_ms=timing.ingress_s(headers) * 1000,
            tenant_ms=timing.tenant_s * 1000, router_queue_ms=p.queued_s * 1000,
            explain=headers.get(EXPLAIN_HEADER, "").lower() in ("1", "true", "yes"), router=self._instance,
            carry_on=[w.address for w in p.others[:self._moves]],
        )
        m = direct.metering
        m.tenant, m.tier, m.key_id = principal.tenant, principal.tier, principal.key_id
        m.model, m.model_version = model.name, model.version
        m.adapter = model.adapter.name if model.adapter is not None else ""
        if metered is not None:
            m.price_input, m.price_cached_input, m.price_output = (
                metered.price.input, metered.price.cached_input, metered.price.output)
            m.admitted = metered.admitted
        m.client_request_id = client_id
        m.prompt_tokens = sum(pp.prompt_tokens for pp in g.prepared)
        if g.plan is not None:
            held, policy = g.plan.held, self._pipeline.sessions.policy
            s = direct.session
            s.session_id, s.version, s.context, s.keep_from = held.session_id, held.version, held.context.to_json(), \
                held.keep_from
            s.new.extend(inference_pb2.ChatMessage(role=r, content=c) for r, c in held.new)
            s.ttl_seconds, s.truncation = policy.ttl_seconds, policy.truncation
        direct.router_ms = max(0.0, (time.perf_counter() - timing.arrived) * 1000 - direct.tenant_ms
                               - direct.router_queue_ms)
        direct.decided_unix = time.time()
        return direct


@dataclass(frozen=True, slots=True)
class Decided:
    """A generation decided at the ingress: what the worker is sent, where, and the request as the
    pipeline admitted it."""

    direct: worker_pb2.DirectGenerate
    placement: DirectPlacement
    generation: Generation


@dataclass(slots=True)
class _Pending:
    """A request sent straight to a worker, until the worker's report of its end."""

    placement: DirectPlacement
    # Its usage record, which the worker commits (None: none, or the tenant's place already given back).
    metered: Metered | None
    # A session's turn: held (and renewed) by this router until then.
    turn: Held | None = None
    # When it was decided (monotonic).
    decided: float = 0.0
