"""gaas.v1.OpenAI: the routes of vLLM's OpenAI-compatible server over HttpBody methods behind the
ingress's transcoder. Failures before the first byte are raised (the interceptor turns them into
statuses, the ingress into HTTP statuses and OpenAI's error JSON); after it, an SSE error event
that says what happened ends the stream, as vLLM's server ends it."""

from __future__ import annotations

import time

from google.api import httpbody_pb2
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gaas.contracts import errors, jsonbody, latency
from gaas.openai import api as openai_api, stream as openai_stream
from gaas.metering.meter import Meter
from gaas.openai.stream import EXPLAIN_HEADER, SESSION_HEADER
from gaas.contracts.pricing import FREE
from gaas.runtime.context import client_request_id_var, current_request_id
from gaas.v1 import inference_pb2, openai_pb2_grpc
from services.router.auth import Authenticator
from services.router.dispatch import Dispatcher, merge
from services.router.servicer import (
    admit, admit_generation, admit_usage, metered, note_client_id, prepare_one, released_on_error, with_session,
)
from services.router.sessions import SessionStore


class OpenAIServicer(openai_pb2_grpc.OpenAIServicer):
    def __init__(
        self, dispatcher: Dispatcher, authenticator: Authenticator, max_body_bytes: int, metrics: CollectorRegistry,
        meter: Meter | None = None, sessions: SessionStore | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._auth = authenticator
        self._max_body = max_body_bytes
        self._metrics = metrics
        self._meter = meter
        self._sessions = sessions

    # ------------------------------------------------------------ models

    async def ListModels(self, request, context) -> httpbody_pb2.HttpBody:
        await admit(self._auth)
        listed = [(m.name, n, m.max_model_len) for m, n in await self._dispatcher.models() if n > 0]
        return openai_stream.json_body(openai_api.models_list(listed, int(time.time())))

    # ------------------------------------------------------------ generation

    async def Completions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, openai_api.parse_completion):
            yield body

    async def ChatCompletions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, openai_api.parse_chat):
            yield body

    async def _serve(self, http: httpbody_pb2.HttpBody, context, parse):
        arrived, arrived_wall = time.perf_counter(), time.time()
        principal = await admit_generation(self._auth, self._meter)
        tenant_s = time.perf_counter() - arrived
        metadata = dict(context.invocation_metadata() or ())
        request_id = current_request_id()
        parsed = parse(jsonbody.parse(http.data, self._max_body))
        note_client_id(parsed.client_request_id)
        session_id = session_id_of(parsed, metadata)
        requests = engine_requests(parsed)
        if session_id and len(requests) > 1:
            raise errors.InvalidArgument("a session turn is one prompt, not a batch", param="prompt")
        # Every prompt is checked and tokenized before anything is generated.
        if session_id:
            first, plan = await prepare_one(self._dispatcher, self._sessions, requests[0], principal, request_id)
            prepared = [first]
        else:
            prepared, plan = [await self._dispatcher.prepare(r, principal) for r in requests], None
        with released_on_error(self._sessions, plan):
            # (max_tokens known now for every prompt, a chat's without one included)
            openai_api.check_answer(parsed, [p.request.max_tokens for p in prepared])
            fmt = openai_api.Formatter(parsed, request_id, prepared[0].model.name)
            n = parsed.n
            usage = openai_stream.Usage(prompt=sum(p.prompt_tokens for p in prepared),
                           explain=metadata.get(EXPLAIN_HEADER, "").lower() in ("1", "true", "yes"))
            remaining = context.time_remaining()
            admitting = time.perf_counter()
            metered_request = await admit_usage(
                self._meter, principal, prepared, request_id, sum(n * p.request.max_tokens for p in prepared), arrived,
                session_id,
            )
            tenant_s += time.perf_counter() - admitting + (plan.tenant_s if plan else 0.0)
        ingress_s = latency.ingress_seconds(metadata, arrived_wall)
        streams = [
            with_session(self._sessions, plan, self._dispatcher.stream(
                p, principal, request_id if len(prepared) == 1 else f"{request_id}-{i}", remaining, arrived, tenant_s,
                ingress_s, on_abandoned=metered_request.abandoned.append if metered_request is not None else None))
            for i, p in enumerate(prepared)
        ]
        chunks = metered(
            self._meter, metered_request, merge(streams), chunk_of=lambda pair: pair[1],
            on_last=lambda c: self._dispatcher.observe_latency(c.timings, principal.tier),
        )
        truncation = self._sessions.policy.truncation if self._sessions is not None else ""
        async for body in openai_stream.respond(parsed, fmt, usage, chunks, truncation):
            yield body

    # ------------------------------------------------------------ tokenizer

    async def Tokenize(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        arrived = time.perf_counter()
        principal = await admit_generation(self._auth, self._meter)
        t = openai_api.parse_tokenize(jsonbody.parse(request.data, self._max_body))
        model = await self._dispatcher.resolve_model(t.model)
        tok = await self._dispatcher.tokenizer(model)
        text = inference_pb2.GenerateRequest(add_special_tokens=t.add_special_tokens)
        if t.prompt is not None:
            text.prompt = t.prompt
        else:
            text.messages.extend(t.messages)
            text.add_generation_prompt = t.add_generation_prompt
            text.continue_final_message = t.continue_final_message
        # A request against the tenant's quotas (not billed): its place and the most tokens it can
        # hold (its bytes, and the chat template's few per message) reserved, settled to its count.
        m = None
        if self._meter is not None:
            most = len(t.prompt.encode()) if t.prompt is not None else sum(len(x.content.encode()) + 16 for x in t.messages)
            m = await self._meter.admit(principal, current_request_id(), model.name, model.version, FREE, most + 16, 0,
                                        1, client_request_id_var.get(), arrived)
        ids: list[int] = []
        try:
            ids = await self._dispatcher.tokenize(tok, text)  # (a long one off the event loop)
        finally:
            if m is not None:
                self._meter.release_later(m, len(ids))
        strs = [tok.id_to_token(i) or "" for i in ids] if t.return_token_strs else None
        return openai_stream.json_body({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs})

    async def Detokenize(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        await admit(self._auth)
        name, tokens = openai_api.parse_detokenize(jsonbody.parse(request.data, self._max_body))
        model = await self._dispatcher.resolve_model(name)
        tok = await self._dispatcher.tokenizer(model)
        for i, t in enumerate(tokens):
            if t >= tok.vocab_size:
                raise errors.InvalidArgument(
                    f"'tokens[{i}]' is {t}, not a token id of {model.name} (its vocabulary has {tok.vocab_size})",
                    param="tokens",
                )
        return openai_stream.json_body({"prompt": tok.decode(tokens)})

    # ------------------------------------------------------------ probes (no API key, as on vLLM)

    async def Health(self, request, context) -> httpbody_pb2.HttpBody:
        if not any(n for _, n in await self._dispatcher.models()):
            raise errors.Unavailable("no model has a ready worker")
        return httpbody_pb2.HttpBody(content_type="text/plain", data=b"")

    async def Ping(self, request, context) -> httpbody_pb2.HttpBody:
        return await self.Health(request, context)

    async def Version(self, request, context) -> httpbody_pb2.HttpBody:
        return openai_stream.json_body({"version": await self._dispatcher.engine_version()})

    async def Load(self, request, context) -> httpbody_pb2.HttpBody:
        return openai_stream.json_body({"server_load": self._dispatcher.in_flight})

    async def Metrics(self, request, context) -> httpbody_pb2.HttpBody:
        return httpbody_pb2.HttpBody(content_type=CONTENT_TYPE_LATEST, data=generate_latest(self._metrics))


def session_id_of(parsed: openai_api.OpenAIRequest, metadata: dict) -> str:
    """The session a request is a turn of: the x-gaas-session header or the body's session_id
    (both: they must agree); set on the engine request."""
    header = metadata.get(SESSION_HEADER, "")
    body = parsed.generate.session_id
    if header and body and header != body:
        raise errors.InvalidArgument(f"the {SESSION_HEADER} header and the body's session_id name different sessions",
                                     param="session_id")
    parsed.generate.session_id = header or body
    return parsed.generate.session_id


def engine_requests(parsed: openai_api.OpenAIRequest) -> list[inference_pb2.GenerateRequest]:
    """One engine request per prompt (chat: the conversation)."""
    if parsed.kind == "chat":
        return [parsed.generate]
    out = []
    for prompt in parsed.prompts:
        r = inference_pb2.GenerateRequest()
        r.CopyFrom(parsed.generate)
        if isinstance(prompt, str):
            r.prompt = prompt
        else:
            r.prompt_token_ids.extend(prompt)
        out.append(r)
    return out

