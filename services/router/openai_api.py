"""OpenAI's HTTP API, translated: request bodies to GenerateRequest (strictly: unknown fields and
wrong types are refused with a message naming them), and GaaS chunks to OpenAI's JSON objects and
server-sent events. Pure functions, no I/O and no gRPC."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from gaas.v1 import common_pb2, inference_pb2

DONE = b"data: [DONE]\n\n"
FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}

_SAMPLING_FIELDS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 100.0),
}
_COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "user", "logprobs",
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix", "logit_bias"}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "logit_bias",
}
CHAT_ROLES = ("system", "user", "assistant")


class BadRequest(ValueError):
    """The body cannot be served; str() names the field and what is wrong with it."""


@dataclass(slots=True)
class OpenAIRequest:
    generate: inference_pb2.GenerateRequest
    stream: bool
    # Send a last chunk with the usage (stream_options.include_usage).
    include_usage: bool


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be a number, not {_type_name(value)}")
    if not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be between {lo:g} and {hi:g}, got {value:g}")
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, not {_type_name(value)}")
    if value < lo or (hi is not None and value > hi):
        raise BadRequest(f"'{name}' must be {'at least ' + str(lo) if hi is None else f'between {lo} and {hi}'}, got {value}")
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, not {_type_name(value)}")
    return value


def _unsupported(body: dict, name: str, allowed: tuple) -> None:
    if body.get(name) not in allowed:
        raise BadRequest(f"'{name}' is not supported by this server (leave it out)")


def parse_json(raw: bytes, max_bytes: int) -> dict:
    if len(raw) > max_bytes:
        raise BadRequest(f"the request body is {len(raw)} bytes; the limit is {max_bytes} bytes")
    if not raw.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not {_type_name(body)}")
    return body


def _common(body: dict, allowed: set[str]) -> OpenAIRequest:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(repr(u) for u in unknown)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: the name of a model (GET /v1/models lists them)")
    req = inference_pb2.GenerateRequest(model=model)
    for name, (lo, hi) in _SAMPLING_FIELDS.items():
        if (v := _number(body, name, lo, hi)) is not None:
            setattr(req.sampling, name, v)
    if (top_k := _integer(body, "top_k", -1)) is not None:
        if top_k == 0:
            raise BadRequest("'top_k' must be -1 (all tokens) or positive")
        req.sampling.top_k = top_k
    if (seed := _integer(body, "seed", -(2**63), 2**63 - 1)) is not None:
        req.sampling.seed = seed
    if _integer(body, "n", 1) not in (None, 1):
        raise BadRequest("'n' must be 1: this server returns one choice per request")
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop.extend(stop)
    elif stop is not None:
        raise BadRequest("'stop' must be a string or an array of strings")
    if not isinstance(body.get("user", ""), str):
        raise BadRequest("'user' must be a string")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise BadRequest("'stream_options' must be an object with 'include_usage'")
        include_usage = _boolean(options, "include_usage")
    return OpenAIRequest(req, stream, include_usage)


def parse_completion(body: dict) -> OpenAIRequest:
    parsed = _common(body, COMPLETION_FIELDS)
    req = parsed.generate
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        req.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise BadRequest("'prompt' holds several prompts: send one per request")
    elif prompt is None or prompt == "" or prompt == []:
        raise BadRequest("'prompt' is required: a non-empty string or an array of token ids")
    else:
        raise BadRequest(f"'prompt' must be a string or an array of token ids (integers >= 0), not {_type_name(prompt)}")
    if (max_tokens := _integer(body, "max_tokens", 1)) is not None:
        req.max_tokens = max_tokens
    _unsupported(body, "echo", (None, False))
    _unsupported(body, "best_of", (None, 1))
    _unsupported(body, "suffix", (None, ""))
    _unsupported(body, "logprobs", (None, 0))
    _unsupported(body, "logit_bias", (None, {}))
    return parsed


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise BadRequest(f"messages[{i}].content must be a string or an array of text parts")


def parse_chat(body: dict) -> OpenAIRequest:
    parsed = _common(body, CHAT_FIELDS)
    req = parsed.generate
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required: a non-empty array of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        unknown = set(m) - {"role", "content", "name"}
        if unknown:
            raise BadRequest(f"messages[{i}]: unsupported field(s) {', '.join(sorted(unknown))}")
        if m.get("role") not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}")
        req.messages.add(role=m["role"], content=_content(m, i))
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    _unsupported(body, "logprobs", (None, False))
    _unsupported(body, "top_logprobs", (None, 0))
    _unsupported(body, "logit_bias", (None, {}))
    _unsupported(body, "tools", (None, []))
    _unsupported(body, "tool_choice", (None, "none"))
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("'response_format' other than {'type': 'text'} is not supported")
    return parsed


# ------------------------------------------------------------------ answers


def usage(chunk: common_pb2.GenerateChunk) -> dict:
    u = chunk.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def finish_reason(chunk: common_pb2.GenerateChunk) -> str | None:
    return FINISH_REASONS.get(chunk.finish_reason)


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class Formatter:
    """Builds the answer objects of one request (same id, timestamp and model in all of them)."""

    def __init__(self, kind: str, request_id: str, model: str) -> None:
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id.replace("-", "")
        self.created = int(time.time())
        self.model = model

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, final: common_pb2.GenerateChunk) -> dict:
        """The whole answer of a non-streamed request."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            obj = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            obj = self._base("text_completion")
        choice["finish_reason"] = finish_reason(final)
        return {**obj, "choices": [choice], "usage": usage(final)}

    def chunk(self, text: str | None, finish: str | None, include_usage: bool, first: bool = False) -> dict:
        """One streamed piece (text None: a chat chunk without content, e.g. the closing one)."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = self._base("text_completion")
        out = {**obj, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, final: common_pb2.GenerateChunk) -> dict:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        obj = self._base("chat.completion.chunk" if self.chat else "text_completion")
        return {**obj, "choices": [], "usage": usage(final)}


def error_event(code_name: str, message: str) -> bytes:
    """An error after the stream started (the HTTP status is already 200), as OpenAI sends it."""
    return sse({"error": {"message": message, "type": "server_error" if code_name != "INVALID_ARGUMENT" else "invalid_request_error", "param": None, "code": code_name.lower()}})


def models_list(models: list[tuple[str, int, int]]) -> dict:
    """models: (name, ready workers, context length)."""
    now = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "gaas", "max_model_len": ctx, "ready_workers": ready}
            for name, ready, ctx in models
        ],
    }
