"""An OpenAI answer from a generation's chunks, for whoever serves the request: the router (its
gaas.v1.OpenAI routes) or a worker the ingress sent the request to straight (ingress.path:
direct). Failures before the first byte are raised (the server interceptor turns them into
statuses, the ingress into HTTP statuses and OpenAI's error JSON); after it, an SSE error event
that says what happened ends the stream, as vLLM's server ends it."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from google.api import httpbody_pb2

from gaas.contracts import edge, errors, latency
from gaas.contracts import finish as finish_reasons
from gaas.openai.api import OpenAIRequest
from gaas.runtime.status import translate
from gaas.v1 import common_pb2, inference_pb2

JSON = "application/json"
SSE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# OpenAI's logprobs floor for tokens that could not have been sampled (JSON has no -inf).
LOGPROB_FLOOR = -9999.0


def json_body(obj: dict) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=JSON, data=dumps(obj))


def answer_pieces(answer: bytes) -> Iterator[httpbody_pb2.HttpBody]:
    """A whole JSON answer in pieces: the ingress's transcoder appends each to the one body it
    sends, holding none of them whole (it refuses a single message larger than its buffer)."""
    for start in range(0, len(answer), edge.ANSWER_PIECE_BYTES):
        yield httpbody_pb2.HttpBody(content_type=JSON, data=answer[start:start + edge.ANSWER_PIECE_BYTES])


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


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def finish_reason(chunk: common_pb2.GenerateChunk) -> str | None:
    return finish_reasons.openai(chunk.finish_reason)


def stop_reason(chunk: common_pb2.GenerateChunk) -> str | None:
    """What vLLM calls stop_reason: the stop string that matched (None for EOS or length)."""
    return chunk.stop_reason or None


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: dict) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class Formatter:
    """Builds the answer objects of one request (same id, timestamp and model in all of them).

    Choices are indexed as the request's chunks say (prompt_index * n + i for completions)."""

    def __init__(self, parsed: OpenAIRequest, request_id: str, model: str) -> None:
        self.chat = parsed.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id.removeprefix("req-")
        self.created = int(time.time())
        self.model = model
        self.top = parsed.top_logprobs
        self.tokens_as_ids = parsed.tokens_as_ids
        self.include_usage = parsed.include_usage
        self.tool_mode = parsed.generate.tool_calling.mode
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        # Completions' text_offset continues across a choice's chunks.
        self._offsets: dict[int, int] = {}
        # The streamed choices that made tool calls.
        self._called: set[int] = set()

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _token(self, token_id: int, text: str) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else text

    def _chat_entry(self, e) -> dict:
        token = self._token(e.token_id, e.token)
        return {
            "token": token, "logprob": _floor(e.logprob), "bytes": list(token.encode("utf-8", "replace")),
            "top_logprobs": [
                {"token": (t := self._token(a.token_id, a.token)), "logprob": _floor(a.logprob),
                 "bytes": list(t.encode("utf-8", "replace"))}
                for a in e.top if 1 <= a.rank <= self.top
            ],
        }

    def logprobs(self, index: int, entries) -> dict | None:
        """OpenAI's logprobs object for a choice's tokens (None when the request asked for none)."""
        if self.top is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for e in entries:
            token = self._token(e.token_id, e.token)
            tokens.append(token)
            token_logprobs.append(_floor(e.logprob))
            top.append({self._token(a.token_id, a.token): _floor(a.logprob) for a in e.top})
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}

    def answer_logprobs(self, index: int) -> "AnswerLogprobs | None":
        """A non-streamed choice's logprobs, assembled as its chunks come (None: none asked for)."""
        return None if self.top is None else AnswerLogprobs(self, index)

    def answer(self, choices: list[tuple[int, str, "AnswerLogprobs | None", common_pb2.GenerateChunk, list[dict]]],
               usage_obj: dict, extra: dict | None = None) -> bytes:
        """The whole answer of a non-streamed request, as JSON: choices (index, text, logprobs,
        final chunk, tool calls) in index order, the usage and extra fields. Built from each
        choice's serialized pieces, never as one tree of objects of the whole answer."""
        obj = self._base("chat.completion" if self.chat else "text_completion")
        parts = []
        for index, text, logprobs, final, calls in sorted(choices, key=lambda c: c[0]):
            raw = dumps(self.choice(index, text, None, final, calls))
            if logprobs is not None:
                # (the key's quotes are unescaped: no string value can hold this)
                raw = raw.replace(b'"logprobs":null', b'"logprobs":' + logprobs.json(), 1)
            parts.append(raw)
        tail = dumps({"usage": usage_obj, **(extra or {})})
        return dumps(obj)[:-1] + b',"choices":[' + b",".join(parts) + b"]," + tail[1:]

    def choice(self, index: int, text: str, logprobs: dict | None, final: common_pb2.GenerateChunk,
               calls: list[dict] = ()) -> dict:
        out: dict = {"index": index}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text if text or not calls else None,
                              "tool_calls": list(calls)}
        else:
            out["text"] = text
        out.update(logprobs=logprobs, finish_reason=self._finish(final, bool(calls)), stop_reason=stop_reason(final))
        return out

    def _finish(self, c: common_pb2.GenerateChunk, called: bool) -> str | None:
        """OpenAI's finish reason: "tool_calls" when tool_choice "auto" made calls, or "required"
        made them and stopped; a named function's call ends as "stop" (as vLLM's server answers)."""
        reason = finish_reason(c)
        if called and (self.tool_mode == inference_pb2.ToolCalling.MODE_AUTO or (
                self.tool_mode == inference_pb2.ToolCalling.MODE_REQUIRED and reason == "stop")):
            return "tool_calls"
        return reason

    def chunk(self, index: int, c: common_pb2.GenerateChunk, first: bool, usage_obj: dict | None = None) -> dict:
        """One streamed piece of choice index; first: the choice's first (chat sends the role then)."""
        choice: dict = {"index": index}
        if self.chat:
            delta: dict = {"role": "assistant", "content": c.text} if first else ({"content": c.text} if c.text else {})
            if c.tool_calls:
                delta["tool_calls"] = [tool_call_delta(t) for t in c.tool_calls]
                self._called.add(index)
            choice["delta"] = delta
        else:
            choice["text"] = c.text
        finish = self._finish(c, index in self._called) if c.finish_reason else None
        choice["logprobs"] = self.logprobs(index, c.logprobs)
        choice["finish_reason"] = finish
        if finish:
            choice["stop_reason"] = stop_reason(c)
        out = {**self._base(self.object), "choices": [choice]}
        if self.include_usage:
            out["usage"] = usage_obj
        return out

    def usage_chunk(self, usage_obj: dict) -> dict:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        return {**self._base(self.object), "choices": [], "usage": usage_obj}


def tool_call_delta(t: common_pb2.ToolCall) -> dict:
    """A streamed piece of a tool call, in OpenAI's delta shape (id, type and name on its first)."""
    out: dict = {"index": t.index}
    fn: dict = {}
    if t.id:
        out["id"], out["type"] = t.id, "function"
    if t.name:
        fn["name"] = t.name
    fn["arguments"] = t.arguments
    out["function"] = fn
    return out


class ToolCalls:
    """A non-streamed choice's tool calls, assembled from its chunks' pieces."""

    def __init__(self) -> None:
        self._calls: dict[int, dict] = {}

    def add(self, pieces) -> None:
        for t in pieces:
            call = self._calls.get(t.index)
            if call is None:
                call = self._calls[t.index] = {"id": t.id, "type": "function",
                                               "function": {"name": t.name, "arguments": ""}}
            call["function"]["arguments"] += t.arguments

    def json(self) -> list[dict]:
        return [self._calls[i] for i in sorted(self._calls)]


class AnswerLogprobs:
    """One choice's logprobs for a non-streamed answer, kept serialized as its chunks come (a
    token's alternatives are one short JSON text, not a tree of Python objects), so an answer's
    memory is about the size of its JSON (gaas.contracts.edge.MAX_ANSWER_LOGPROBS bounds it)."""

    def __init__(self, fmt: Formatter, index: int) -> None:
        self._fmt, self._index = fmt, index
        # chat: each token's content entry; completions: the four arrays, alternatives serialized.
        self._content: list[bytes] = []
        self._offsets: list[int] = []
        self._tokens: list[str] = []
        self._token_logprobs: list[float] = []
        self._top: list[bytes] = []

    def add(self, entries) -> None:
        if self._fmt.chat:
            self._content.extend(dumps(self._fmt._chat_entry(e)) for e in entries)
            return
        obj = self._fmt.logprobs(self._index, entries)
        self._offsets += obj["text_offset"]
        self._tokens += obj["tokens"]
        self._token_logprobs += obj["token_logprobs"]
        self._top.extend(dumps(t) for t in obj["top_logprobs"])

    def json(self) -> bytes:
        if self._fmt.chat:
            return b'{"content":[' + b",".join(self._content) + b"]}"
        arrays = dumps({"text_offset": self._offsets, "token_logprobs": self._token_logprobs, "tokens": self._tokens})
        return arrays[:-1] + b',"top_logprobs":[' + b",".join(self._top) + b"]}"


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    # A non-streamed answer's logprobs, assembled as they come (None: none asked for).
    logprobs: AnswerLogprobs | None = None
    final: common_pb2.GenerateChunk | None = None
    started: bool = False
    # A non-streamed chat's tool calls (None until the first piece of one).
    calls: ToolCalls | None = None


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
        out = usage_json(self.reported_prompt or self.prompt, self.completion, self.cached)
        if self.explain and self.timings is not None:
            out[EXPLAIN_FIELD] = latency.as_dict(self.timings)
        return out

    def running(self) -> dict:
        return usage_json(self.prompt, self.completion, None)


def session_json(s: common_pb2.SessionTurn, truncation: str) -> dict:
    """What a turn did to its session, as the OpenAI routes return it."""
    out = {"id": s.session_id, "version": s.version, "turns": s.turns, "context_tokens": s.context_tokens,
           "created": s.created}
    if s.dropped_turns:
        out["truncated"] = {"dropped_turns": s.dropped_turns, "dropped_tokens": s.dropped_tokens,
                            "policy": truncation}
    return out



async def respond(
    parsed: OpenAIRequest, fmt: Formatter, usage: Usage,
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
                        choice.calls = ToolCalls()
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
            yield sse_body(sse(event))
            choice.started = started = True
    except Exception as exc:  # noqa: BLE001 - answered in the shape the client can read
        if not started:
            raise
        err = translate(exc)
        if err is None:
            raise
        yield sse_body(sse(errors.openai_error(err)))
        yield sse_body(DONE)
        return
    if not parsed.stream:
        answer = fmt.answer([(i, "".join(ch.text), ch.logprobs, ch.final or common_pb2.GenerateChunk(),
                              ch.calls.json() if ch.calls is not None else [])
                             for i, ch in choices.items()], usage.final(),
                            {SESSION_FIELD: turn} if turn is not None else None)
        choices.clear()
        for piece in answer_pieces(answer):
            yield piece
        return
    if parsed.include_usage or usage.explain:
        yield sse_body(sse(fmt.usage_chunk(usage.final())))
    yield sse_body(DONE)

