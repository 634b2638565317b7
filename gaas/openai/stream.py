"""An OpenAI answer from a generation's chunks, for whoever serves the request: the router (its
gaas.v1.OpenAI routes) or a worker the ingress sent the request to straight (ingress.path:
direct). Failures before the first byte are raised (the server interceptor turns them into
statuses, the ingress into HTTP statuses and OpenAI's error JSON); after it, an SSE error event
that says what happened ends the stream, as vLLM's server ends it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from google.api import httpbody_pb2

from gaas.contracts import edge, errors, latency
from gaas.openai import api as openai_api
from gaas.runtime.status import translate
from gaas.v1 import common_pb2

JSON = "application/json"
SSE = "text/event-stream"


def json_body(obj: dict) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=JSON, data=openai_api.dumps(obj))


def sse_body(data: bytes) -> httpbody_pb2.HttpBody:
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
    # A non-streamed answer's logprobs, assembled as they come (None: none asked for).
    logprobs: openai_api.AnswerLogprobs | None = None
    final: common_pb2.GenerateChunk | None = None
    started: bool = False
    # A non-streamed chat's tool calls (None until the first piece of one).
    calls: openai_api.ToolCalls | None = None


@dataclass(slots=True)
class Usage:
    prompt: int
    completion: int = 0
    cached: int = 0
    # The engine's own prompt counts, as the final chunks report them.
    reported_prompt: int = 0
    # The latency decomposition (the slowest part of the request's), when the client asked for it.
    explain: bool = False
    timings: common_pb2.Timings | None = None

    def count(self, c: common_pb2.GenerateChunk) -> None:
        """Count a chunk as it goes out: its tokens, and the usage a final chunk reports."""
        self.completion += len(c.token_ids)
        if c.HasField("usage"):
            self.add_final(c)

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


def session_json(s: common_pb2.SessionTurn, truncation: str) -> dict:
    """What a turn did to its session, as the OpenAI routes return it."""
    out = {"id": s.session_id, "version": s.version, "turns": s.turns, "context_tokens": s.context_tokens,
           "created": s.created}
    if s.dropped_turns:
        out["truncated"] = {"dropped_turns": s.dropped_turns, "dropped_tokens": s.dropped_tokens,
                            "policy": truncation}
    return out



async def respond(
    parsed: openai_api.OpenAIRequest, fmt: openai_api.Formatter, usage: Usage,
    chunks: AsyncIterator[tuple[int, common_pb2.GenerateChunk]], truncation: str = "",
) -> AsyncIterator[httpbody_pb2.HttpBody]:
    """The answer's bodies, from (which engine request, chunk) pairs already metered: one JSON
    body, or one SSE event per chunk then the usage chunk (when asked) and [DONE]. truncation: the
    session policy's, for a session turn's summary."""
    n = parsed.n
    turn = None
    choices: dict[int, _Choice] = {}
    started = False
    try:
        async for which, c in chunks:
            index = which * n + c.index
            choice = choices.get(index)
            if choice is None:
                choice = choices[index] = _Choice(logprobs=None if parsed.stream else fmt.answer_logprobs(index))
            usage.count(c)
            if c.HasField("session"):
                turn = session_json(c.session, truncation)
            if not parsed.stream:
                choice.text.append(c.text)
                if c.tool_calls:
                    if choice.calls is None:
                        choice.calls = openai_api.ToolCalls()
                    choice.calls.add(c.tool_calls)
                if choice.logprobs is not None and c.logprobs:
                    choice.logprobs.add(c.logprobs)
                if c.finish_reason:
                    choice.final = c
                continue
            # One event per engine step, even when its text is empty (a character still being
            # completed byte by byte): clients see the pace of generation as it is.
            running = usage.running() if parsed.continuous_usage else None
            event = fmt.chunk(index, c, first=not choice.started, usage_obj=running)
            if c.HasField("session"):
                event[SESSION_FIELD] = turn
            yield sse_body(openai_api.sse(event))
            choice.started = started = True
    except Exception as exc:  # noqa: BLE001 - answered in the shape the client can read
        if not started:
            raise
        err = translate(exc)
        if err is None:
            raise
        yield sse_body(openai_api.sse(errors.openai_error(err)))
        yield sse_body(openai_api.DONE)
        return
    if not parsed.stream:
        answer = fmt.answer([(i, "".join(ch.text), ch.logprobs, ch.final or common_pb2.GenerateChunk(),
                              ch.calls.json() if ch.calls is not None else [])
                             for i, ch in choices.items()], usage.final(),
                            {SESSION_FIELD: turn} if turn is not None else None)
        choices.clear()
        # In pieces: the ingress's transcoder appends each to the one JSON body it sends, holding
        # none of them whole (it refuses a single message larger than its buffer).
        for start in range(0, len(answer), edge.ANSWER_PIECE_BYTES):
            yield httpbody_pb2.HttpBody(content_type=JSON, data=answer[start:start + edge.ANSWER_PIECE_BYTES])
        return
    if parsed.include_usage or usage.explain:
        yield sse_body(openai_api.sse(fmt.usage_chunk(usage.final())))
    yield sse_body(openai_api.DONE)

