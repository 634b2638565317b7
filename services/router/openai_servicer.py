"""gaas.v1.OpenAI: the routes of vLLM's OpenAI-compatible server over HttpBody methods behind the
ingress's transcoder. Failures before the first byte are raised (the interceptor turns them into
statuses, the ingress into HTTP statuses and OpenAI's error JSON); after it, an SSE error event
that says what happened ends the stream, as vLLM's server ends it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from google.api import httpbody_pb2
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gaas import errors, latency
from gaas.runtime.context import current_request_id
from gaas.runtime.interceptors import translate
from gaas.tokenizer import ChatMessage
from gaas.v1 import common_pb2, inference_pb2, openai_pb2_grpc
from gaas import jsonbody, openai_api
from services.router.auth import Authenticator
from services.router.dispatch import Dispatcher, merge
from services.router.servicer import (
    admit, admit_usage, metered, note_client_id, prepare_one, released_on_error, with_session,
)
from gaas.meter import Meter
from services.router.sessions import SessionStore

JSON = "application/json"
SSE = "text/event-stream"


def _json(obj: dict) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=JSON, data=openai_api.dumps(obj))


def _event(data: bytes) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=SSE, data=data)


# A request with this header (1, true, yes) gets its latency decomposition in its usage object,
# under EXPLAIN_FIELD, in milliseconds (a streamed one gets the usage chunk for it).
EXPLAIN_HEADER = "x-gaas-explain"
EXPLAIN_FIELD = "gaas_latency_ms"
# A request is a turn of this session (as the body's session_id extension would say); the response
# (the last streamed chunk) says what the turn did to it under SESSION_FIELD.
SESSION_HEADER = "x-gaas-session"
SESSION_FIELD = "gaas_session"


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    final: common_pb2.GenerateChunk | None = None
    started: bool = False


@dataclass(slots=True)
class _Usage:
    prompt: int
    completion: int = 0
    cached: int = 0
    # The engine's own prompt counts, as the final chunks report them.
    reported_prompt: int = 0
    # The latency decomposition (the slowest part of the request's), when the client asked for it.
    explain: bool = False
    timings: common_pb2.Timings | None = None

    def add_final(self, c: common_pb2.GenerateChunk) -> None:
        self.reported_prompt += c.usage.prompt_tokens
        self.cached += c.usage.cached_tokens
        if self.timings is None or c.timings.total_ms > self.timings.total_ms:
            self.timings = c.timings

    def final(self) -> dict:
        out = openai_api.usage(self.reported_prompt or self.prompt, self.completion, self.cached)
        if self.explain and self.timings is not None:
            out[EXPLAIN_FIELD] = latency.as_dict(self.timings)
        return out

    def running(self) -> dict:
        return openai_api.usage(self.prompt, self.completion, None)


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
        return _json(openai_api.models_list(listed, int(time.time())))

    # ------------------------------------------------------------ generation

    async def Completions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, openai_api.parse_completion):
            yield body

    async def ChatCompletions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, openai_api.parse_chat):
            yield body

    async def _serve(self, http: httpbody_pb2.HttpBody, context, parse):
        arrived, arrived_wall = time.perf_counter(), time.time()
        principal = await admit(self._auth)
        tenant_s = time.perf_counter() - arrived
        metadata = dict(context.invocation_metadata() or ())
        request_id = current_request_id()
        parsed = parse(jsonbody.parse(http.data, self._max_body))
        note_client_id(parsed.client_request_id)
        session_id = _session_id(parsed, metadata)
        engine_requests = _engine_requests(parsed)
        if session_id and len(engine_requests) > 1:
            raise errors.InvalidArgument("a session turn is one prompt, not a batch", param="prompt")
        # Every prompt is checked and tokenized before anything is generated.
        if session_id:
            first, plan = await prepare_one(self._dispatcher, self._sessions, engine_requests[0], principal, request_id)
            prepared = [first]
        else:
            prepared, plan = [await self._dispatcher.prepare(r, principal) for r in engine_requests], None
        with released_on_error(self._sessions, plan):
            fmt = openai_api.Formatter(parsed, request_id, prepared[0].model.name)
            n = parsed.n
            usage = _Usage(prompt=sum(p.prompt_tokens for p in prepared),
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
                ingress_s))
            for i, p in enumerate(prepared)
        ]
        turn = None
        choices: dict[int, _Choice] = {}
        started = False
        try:
            async for which, c in metered(
                self._meter, metered_request, merge(streams), chunk_of=lambda pair: pair[1],
                on_last=lambda c: self._dispatcher.observe_latency(c.timings, principal.tier),
            ):
                index = which * n + c.index
                choice = choices.setdefault(index, _Choice())
                usage.completion += len(c.token_ids)
                if c.HasField("usage"):
                    usage.add_final(c)
                if c.HasField("session"):
                    turn = session_json(c.session, self._sessions.policy.truncation)
                if not parsed.stream:
                    choice.text.append(c.text)
                    choice.logprobs.extend(c.logprobs)
                    if c.finish_reason:
                        choice.final = c
                    continue
                # One event per engine step, even when its text is empty (a character still being
                # completed byte by byte): clients see the pace of generation as it is.
                running = usage.running() if parsed.continuous_usage else None
                event = fmt.chunk(index, c, first=not choice.started, usage_obj=running)
                if c.HasField("session"):
                    event[SESSION_FIELD] = turn
                yield _event(openai_api.sse(event))
                choice.started = started = True
        except Exception as exc:  # noqa: BLE001 - answered in the shape the client can read
            if not started:
                raise
            err = translate(exc)
            if err is None:
                raise
            yield _event(openai_api.sse(errors.openai_error(err)))
            yield _event(openai_api.DONE)
            return
        if not parsed.stream:
            out = [
                fmt.choice(i, "".join(ch.text), fmt.logprobs(i, ch.logprobs), ch.final or common_pb2.GenerateChunk())
                for i, ch in choices.items()
            ]
            body = fmt.response(out, usage.final())
            if turn is not None:
                body[SESSION_FIELD] = turn
            yield _json(body)
            return
        if parsed.include_usage or usage.explain:
            yield _event(openai_api.sse(fmt.usage_chunk(usage.final())))
        yield _event(openai_api.DONE)

    # ------------------------------------------------------------ tokenizer

    async def Tokenize(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        await admit(self._auth)
        t = openai_api.parse_tokenize(jsonbody.parse(request.data, self._max_body))
        model = await self._dispatcher.resolve_model(t.model)
        tok = await self._dispatcher.tokenizer(model)
        if t.prompt is not None:
            ids = tok.encode(t.prompt, t.add_special_tokens)
        else:
            messages = [ChatMessage(m.role, m.content) for m in t.messages]
            ids = tok.encode_chat(messages, t.add_generation_prompt, t.continue_final_message, t.add_special_tokens)
        strs = [tok.id_to_token(i) or "" for i in ids] if t.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs})

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
        return _json({"prompt": tok.decode(tokens)})

    # ------------------------------------------------------------ probes (no API key, as on vLLM)

    async def Health(self, request, context) -> httpbody_pb2.HttpBody:
        if not any(n for _, n in await self._dispatcher.models()):
            raise errors.Unavailable("no model has a ready worker")
        return httpbody_pb2.HttpBody(content_type="text/plain", data=b"")

    async def Ping(self, request, context) -> httpbody_pb2.HttpBody:
        return await self.Health(request, context)

    async def Version(self, request, context) -> httpbody_pb2.HttpBody:
        return _json({"version": await self._dispatcher.engine_version()})

    async def Load(self, request, context) -> httpbody_pb2.HttpBody:
        return _json({"server_load": self._dispatcher.in_flight})

    async def Metrics(self, request, context) -> httpbody_pb2.HttpBody:
        return httpbody_pb2.HttpBody(content_type=CONTENT_TYPE_LATEST, data=generate_latest(self._metrics))


def _session_id(parsed: openai_api.OpenAIRequest, metadata: dict) -> str:
    """The session a request is a turn of: the x-gaas-session header or the body's session_id
    (both: they must agree); set on the engine request."""
    header = metadata.get(SESSION_HEADER, "")
    body = parsed.generate.session_id
    if header and body and header != body:
        raise errors.InvalidArgument(f"the {SESSION_HEADER} header and the body's session_id name different sessions",
                                     param="session_id")
    parsed.generate.session_id = header or body
    return parsed.generate.session_id


def session_json(s: common_pb2.SessionTurn, truncation: str) -> dict:
    """What a turn did to its session, as the OpenAI routes return it."""
    out = {"id": s.session_id, "version": s.version, "turns": s.turns, "context_tokens": s.context_tokens,
           "created": s.created}
    if s.dropped_turns:
        out["truncated"] = {"dropped_turns": s.dropped_turns, "dropped_tokens": s.dropped_tokens,
                            "policy": truncation}
    return out


def _engine_requests(parsed: openai_api.OpenAIRequest) -> list[inference_pb2.GenerateRequest]:
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

