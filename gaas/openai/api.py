"""The HTTP API of vLLM's OpenAI-compatible server, translated: request bodies to GenerateRequests
(strictly: each field's type and range is checked, unknown fields are refused, and what GaaS
cannot honour is refused with a 400 naming it, never silently ignored), and GaaS chunks to
OpenAI's JSON objects and server-sent events, in the shapes vLLM answers with. Pure functions, no
I/O and no gRPC; failures are gaas.contracts.errors.InvalidArgument.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from gaas.contracts import edge, genrequest
from gaas.contracts import finish as finish_reasons
from gaas.contracts.errors import InvalidArgument, quote
from gaas.v1 import common_pb2, inference_pb2
from gaas.openai import outputs
from gaas.contracts.jsonbody import INT64_MAX, INT64_MIN, UINT32_MAX, Fields, int_items, is_digits, type_name

DONE = b"data: [DONE]\n\n"
MAX_PROMPTS = 64
MAX_CHOICES = 64
MAX_USER_CHARS = 256
# OpenAI's logprobs floor for tokens that could not have been sampled (JSON has no -inf).
LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class OpenAIRequest:
    kind: str  # "completion" or "chat"
    # Model, sampling and output settings; for chat also the messages. Completions put each
    # prompt in a copy of it (see prompts).
    generate: inference_pb2.GenerateRequest
    # Completions: one entry per prompt (text, or token ids); each becomes its own engine request
    # and its choices are indexed prompt_index * n + i, as vLLM does.
    prompts: list[str | list[int]] = field(default_factory=list)
    stream: bool = False
    # stream_options: a last chunk with the usage; usage on every chunk.
    include_usage: bool = False
    continuous_usage: bool = False
    # Top alternatives per token to return, None for no logprobs at all.
    top_logprobs: int | None = None
    # Logprob tokens as "token_id:N" instead of text.
    tokens_as_ids: bool = False
    # The id the client gave in the body (vLLM's request_id field), for the logs.
    client_request_id: str = ""

    @property
    def n(self) -> int:
        return self.generate.n or 1


# ------------------------------------------------------------------ parsing

# Fields vLLM's server knows that GaaS accepts only at their default: (test, what GaaS lacks).
_ONLY_DEFAULT = {
    "echo": (lambda v: v is False, "the prompt is not echoed"),
    "use_beam_search": (lambda v: v is False, "no beam search"),
    "length_penalty": (lambda v: v == 1, "no beam search"),
    "watermarking": (lambda v: v is False, "no watermarking"),
    "truncate_prompt_tokens": (lambda v: False, "prompts are never truncated"),
    "truncation_side": (lambda v: False, "prompts are never truncated"),
    "prompt_logprobs": (lambda v: False, "no prompt logprobs"),
    "logprob_token_ids": (lambda v: v == [], "no logprobs of chosen token ids"),
    "prompt_embeds": (lambda v: False, "no prompt embeddings"),
    "return_token_ids": (lambda v: v is False, "token ids are not returned in the response"),
    "return_token_offsets": (lambda v: v is False, "no token offsets"),
    "return_prompt_text": (lambda v: v is False, "the prompt text is not returned"),
    "routed_experts_prompt_start": (lambda v: v == 0, "no expert routing"),
    "mm_payload": (lambda v: v == "tensors", "no multimodal input"),
    "return_mm_kwargs": (lambda v: v is False, "no multimodal input"),
    "media_io_kwargs": (lambda v: v == {}, "no multimodal input"),
    "mm_processor_kwargs": (lambda v: v == {}, "no multimodal input"),
    "cache_salt": (lambda v: False, "GaaS salts each tenant's prefix cache itself"),
    "kv_transfer_params": (lambda v: False, "no KV transfer"),
    "ec_transfer_params": (lambda v: False, "no encoder-cache transfer"),
    "vllm_xargs": (lambda v: v == {}, "no extra engine arguments"),
    "repetition_detection": (lambda v: False, "no repetition detection"),
    "thinking_token_budget": (lambda v: False, "no reasoning budget"),
    "stream_interval": (lambda v: v == 1, "every engine step is streamed"),
}
_COMPLETION_ONLY_DEFAULT = {
    "suffix": (lambda v: v == "", "no suffix insertion"),
    "best_of": (lambda v: v == 1, "use n for several choices"),
}
_CHAT_ONLY_DEFAULT = {
    "functions": (lambda v: v == [], "the legacy functions field: send tools"),
    "function_call": (lambda v: v in ("none", "auto"), "the legacy function_call field: send tool_choice"),
    "reasoning_effort": (lambda v: False, "no reasoning control"),
    "documents": (lambda v: v == [], "no document templates"),
    "chat_template": (lambda v: False, "the model's own chat template is used"),
    "chat_template_kwargs": (lambda v: v == {}, "the model's own chat template is used"),
}
# Accepted and without effect here, as on a vLLM server without a reasoning parser.
_CHAT_TOLERATED = ("include_reasoning",)
# /tokenize: fields of a chat it does not take.
_TOKENIZE_ONLY_DEFAULT = {
    "tools": (lambda v: v == [], "a conversation is tokenized without tools"),
    "chat_template": _CHAT_ONLY_DEFAULT["chat_template"],
    "chat_template_kwargs": _CHAT_ONLY_DEFAULT["chat_template_kwargs"],
}


def _only_defaults(f: Fields, table: dict) -> None:
    for name, (accepted, what) in table.items():
        f.only_default(name, accepted, what)


def _common(f: Fields, kind: str) -> OpenAIRequest:
    model = f.string("model", genrequest.MAX_MODEL_NAME)
    if not model:
        raise InvalidArgument("'model' is required: the name of a model (GET /v1/models lists them)", param="model")
    req = inference_pb2.GenerateRequest(model=model)
    sp = req.sampling
    for name in genrequest.FLOAT_RANGES:
        if (v := f.number(name, -math.inf, math.inf)) is not None:
            setattr(sp, name, genrequest.check_float(name, v))
    if (top_k := f.integer("top_k", genrequest.TOP_K_MIN, genrequest.TOP_K_MAX)) is not None:
        sp.top_k = top_k
    if (seed := f.integer("seed", genrequest.SEED_MIN, genrequest.SEED_MAX)) is not None:
        sp.seed = seed
    if (min_tokens := f.integer("min_tokens", 0, UINT32_MAX)) is not None:
        sp.min_tokens = min_tokens
    if f.boolean("ignore_eos"):
        sp.ignore_eos = True
    if (ids := f.int_list("stop_token_ids", 0, UINT32_MAX, genrequest.MAX_TOKEN_LIST)) is not None:
        sp.stop_token_ids.extend(ids)
    if (ids := f.int_list("allowed_token_ids", 0, UINT32_MAX, genrequest.MAX_TOKEN_LIST)) is not None:
        sp.allowed_token_ids.extend(ids)
    if (skip := f.boolean("skip_special_tokens")) is not None:
        sp.skip_special_tokens = skip
    if (spaces := f.boolean("spaces_between_special_tokens")) is not None:
        sp.spaces_between_special_tokens = spaces
    if f.boolean("include_stop_str_in_output"):
        sp.include_stop_str_in_output = True
    if (words := f.str_list("bad_words", genrequest.MAX_BAD_WORDS, genrequest.MAX_STOP_LENGTH)) is not None:
        sp.bad_words.extend(words)
    _logit_bias(f, sp)
    if (stop := f.str_list("stop", genrequest.MAX_STOP_STRINGS, genrequest.MAX_STOP_LENGTH, single_ok=True)) is not None:
        req.stop.extend(stop)
    if (n := f.integer("n", 1, genrequest.MAX_N)) is not None:
        req.n = n
    if (priority := f.integer("priority", INT64_MIN, INT64_MAX)) is not None:
        # vLLM serves lower values first; GaaS has three classes (the tenant's tier bounds them).
        req.priority = (
            common_pb2.PRIORITY_HIGH if priority < 0 else common_pb2.PRIORITY_LOW if priority > 0 else common_pb2.PRIORITY_NORMAL
        )
    if (session := f.string("session_id", genrequest.ID_MAX)) is not None:
        req.session_id = session
    f.string("user", MAX_USER_CHARS)
    client_id = f.string("request_id", genrequest.ID_MAX) or ""
    stream = bool(f.boolean("stream"))
    include_usage = continuous = False
    if (options := f.object("stream_options")) is not None:
        include_usage = bool(options.boolean("include_usage"))
        continuous = bool(options.boolean("continuous_usage_stats"))
        options.finish()
    tokens_as_ids = bool(f.boolean("return_tokens_as_token_ids"))
    if (constraint := outputs.structured_output(f)) is not None:
        req.structured_output.CopyFrom(constraint)
    _only_defaults(f, _ONLY_DEFAULT)
    return OpenAIRequest(
        kind, req, stream=stream, include_usage=include_usage, continuous_usage=continuous and include_usage,
        tokens_as_ids=tokens_as_ids, client_request_id=client_id,
    )


def _logit_bias(f: Fields, sp: common_pb2.SamplingParams) -> None:
    bias = f.object("logit_bias")
    if bias is None:
        return
    if len(bias.body) > genrequest.MAX_LOGIT_BIAS:
        raise f.fail("logit_bias", f"holds {len(bias.body)} entries; at most {genrequest.MAX_LOGIT_BIAS} are accepted")
    for key, value in bias.body.items():
        if not is_digits(key) or len(key) > 10 or int(key) > UINT32_MAX:
            raise f.fail("logit_bias", f"keys must be token ids (\"50256\"), got {quote(key)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise f.fail("logit_bias", f"values must be numbers from -100 to 100, not {type_name(value)}")
        sp.logit_bias[int(key)] = max(-genrequest.LOGIT_BIAS_LIMIT, min(genrequest.LOGIT_BIAS_LIMIT, float(value)))


def _max_tokens(f: Fields, name: str) -> int | None:
    return f.integer(name, 1, UINT32_MAX)


def _prompts(f: Fields) -> list[str | list[int]]:
    """OpenAI's prompt: a string, an array of token ids, or an array of either (a batch)."""
    prompt = f.raw("prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise InvalidArgument(
            "'prompt' is required: a non-empty string, an array of token ids, or an array of those", param="prompt"
        )
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise f.fail("prompt", f"must be a string or an array of token ids, not {type_name(prompt)}")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [int_items(prompt, "prompt", 0, UINT32_MAX, len(prompt))]
    if len(prompt) > MAX_PROMPTS:
        raise f.fail("prompt", f"holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request")
    out: list[str | list[int]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str) and p:
            out.append(p)
        elif isinstance(p, list) and p:
            out.append(int_items(p, f"prompt[{i}]", 0, UINT32_MAX, len(p)))
        else:
            raise InvalidArgument(
                f"'prompt[{i}]' must be a non-empty string or array of token ids, not {type_name(p)}", param="prompt"
            )
    return out


def parse_completion(body: dict) -> OpenAIRequest:
    f = Fields(body)
    parsed = _common(f, "completion")
    parsed.prompts = _prompts(f)
    if len(parsed.prompts) * parsed.n > MAX_CHOICES:
        raise f.fail("n", f"times the {len(parsed.prompts)} prompts makes more than {MAX_CHOICES} choices")
    req = parsed.generate
    if (max_tokens := _max_tokens(f, "max_tokens")) is not None:
        req.max_tokens = max_tokens
    if (logprobs := f.integer("logprobs", 0, genrequest.MAX_LOGPROBS)) is not None:
        req.logprobs = parsed.top_logprobs = logprobs
    if (special := f.boolean("add_special_tokens")) is not None:
        req.add_special_tokens = special
    _only_defaults(f, _COMPLETION_ONLY_DEFAULT)
    f.finish()
    if req.max_tokens:  # known from the body alone: refused before anything is tokenized
        check_answer(parsed, [req.max_tokens] * len(parsed.prompts))
    return parsed


def _content(m: Fields, i: int) -> str:
    content = m.raw("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text") or not isinstance(part.get("text"), str):
                raise InvalidArgument(
                    f"'messages[{i}].content': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                    param="messages",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    if content is None:
        return ""
    raise InvalidArgument(f"'messages[{i}].content' must be a string or an array of text parts", param="messages")


def parse_chat(body: dict) -> OpenAIRequest:
    f = Fields(body)
    parsed = _common(f, "chat")
    req = parsed.generate
    messages = f.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' is required: a non-empty array of {role, content}", param="messages")
    if len(messages) > genrequest.MAX_MESSAGES:
        raise f.fail("messages", f"holds {len(messages)} messages; at most {genrequest.MAX_MESSAGES} are accepted")
    for i, raw in enumerate(messages):
        if not isinstance(raw, dict):
            raise InvalidArgument(f"'messages[{i}]' must be an object with 'role' and 'content'", param="messages")
        m = Fields(raw, prefix=f"messages[{i}].")
        role = m.raw("role")
        if role not in genrequest.CHAT_ROLES:
            raise InvalidArgument(
                f"'messages[{i}].role' must be one of {', '.join(genrequest.CHAT_ROLES)}, got {quote(role)}",
                param="messages",
            )
        content = _content(m, i)
        message = req.messages.add(role=role, content=content, name=m.string("name", MAX_USER_CHARS) or "")
        message.tool_calls.extend(outputs.message_tool_calls(m, i))
        if (call_id := m.string("tool_call_id", 256)) is not None:
            message.tool_call_id = call_id
        if message.tool_calls and role != "assistant":
            raise InvalidArgument(f"'messages[{i}].tool_calls': only an assistant's message holds tool calls",
                                  param="messages")
        m.only_default("refusal", lambda v: True, "")
        m.only_default("reasoning_content", lambda v: True, "")
        m.finish()
    max_tokens = _max_tokens(f, "max_completion_tokens")
    legacy = _max_tokens(f, "max_tokens")
    if (chosen := max_tokens if max_tokens is not None else legacy) is not None:
        req.max_tokens = chosen
    logprobs = f.boolean("logprobs")
    top = f.integer("top_logprobs", 0, genrequest.MAX_LOGPROBS)
    if top and not logprobs:
        raise f.fail("top_logprobs", "needs 'logprobs': true")
    if logprobs:
        req.logprobs = parsed.top_logprobs = top or 0
    if (agp := f.boolean("add_generation_prompt")) is not None:
        req.add_generation_prompt = agp
    if f.boolean("continue_final_message"):
        if agp is not False:
            raise f.fail("continue_final_message", "needs 'add_generation_prompt': false")
        req.continue_final_message = True
    if (special := f.boolean("add_special_tokens")) is not None:
        req.add_special_tokens = special
    for name in _CHAT_TOLERATED:
        f.boolean(name)
    outputs.tools(f, req, parsed.stream)
    _only_defaults(f, _CHAT_ONLY_DEFAULT)
    f.finish()
    if req.max_tokens:
        check_answer(parsed, [req.max_tokens])
    return parsed


def check_answer(parsed: OpenAIRequest, max_tokens: list[int]) -> None:
    """A non-streamed answer is held whole until it is sent: refused before any work (a 400 that
    names the limit) when, at the max_tokens of each prompt, it could hold more than
    gaas.contracts.edge.MAX_ANSWER_TOKENS tokens or MAX_ANSWER_LOGPROBS logprob entries. A streamed one is
    sent as it is made."""
    if parsed.stream:
        return
    tokens = parsed.n * sum(max_tokens)
    if tokens > edge.MAX_ANSWER_TOKENS:
        raise InvalidArgument(
            f"a non-streamed answer holds at most {edge.MAX_ANSWER_TOKENS:,} tokens (n x max_tokens, for each "
            f"prompt); this one could reach {tokens:,}: lower max_tokens or n, send fewer prompts, or stream it "
            "(\"stream\": true)", param="max_tokens")
    if parsed.top_logprobs is not None and (entries := tokens * (1 + parsed.top_logprobs)) > edge.MAX_ANSWER_LOGPROBS:
        raise InvalidArgument(
            f"a non-streamed answer holds at most {edge.MAX_ANSWER_LOGPROBS:,} logprob entries (each token and its "
            f"alternatives); this one could reach {entries:,}: ask for fewer alternatives or tokens, or stream it "
            "(\"stream\": true)", param="top_logprobs" if parsed.kind == "chat" else "logprobs")


@dataclass(slots=True)
class TokenizeRequest:
    model: str
    # Exactly one of prompt and messages.
    prompt: str | None
    messages: list[inference_pb2.ChatMessage]
    add_special_tokens: bool
    add_generation_prompt: bool
    continue_final_message: bool
    return_token_strs: bool


def parse_tokenize(body: dict) -> TokenizeRequest:
    """vLLM's /tokenize body: {model?, prompt | messages, add_special_tokens, ...}."""
    f = Fields(body)
    model = f.string("model", genrequest.MAX_MODEL_NAME) or ""
    return_strs = bool(f.boolean("return_token_strs"))
    if "messages" in body:
        chat = parse_chat({"model": model or "-", "messages": body["messages"]}).generate
        f.raw("messages")
        agp = f.boolean("add_generation_prompt")
        cfm = bool(f.boolean("continue_final_message"))
        if cfm and agp:
            raise f.fail("continue_final_message", "needs 'add_generation_prompt': false")
        special = f.boolean("add_special_tokens")
        _only_defaults(f, _TOKENIZE_ONLY_DEFAULT)
        _only_defaults(f, {k: _ONLY_DEFAULT[k] for k in ("mm_processor_kwargs", "media_io_kwargs")})
        f.finish()
        return TokenizeRequest(model, None, list(chat.messages), bool(special), agp is not False and not cfm, cfm, return_strs)
    prompt = f.string("prompt", genrequest.MAX_PROMPT_CHARS)
    if prompt is None:
        raise InvalidArgument("'prompt' (a string) or 'messages' is required", param="prompt")
    special = f.boolean("add_special_tokens")
    f.finish()
    return TokenizeRequest(model, prompt, [], special is not False, False, False, return_strs)


def parse_detokenize(body: dict) -> tuple[str, list[int]]:
    """vLLM's /detokenize body: {model?, tokens} -> (model, tokens)."""
    f = Fields(body)
    model = f.string("model", genrequest.MAX_MODEL_NAME) or ""
    tokens = f.int_list("tokens", 0, UINT32_MAX, 1 << 20)
    if tokens is None:
        raise InvalidArgument("'tokens' is required: an array of token ids", param="tokens")
    f.finish()
    return model, tokens


# ------------------------------------------------------------------ answers


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
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


def models_list(models: list[tuple[str, int, int, dict[str, str]]], created: int,
                adapters: list[tuple[str, str, int, int]] = ()) -> dict:
    """models: (name, ready workers, context length, version -> its role for the versions with
    workers), shaped as vLLM's model cards (versions: GaaS's own field); adapters: (name, base
    model, ready workers, context length) of the LoRA adapters the caller may use, as vLLM lists
    its LoRA modules (parent: the base model)."""
    return {
        "object": "list",
        "data": [
            {
                "id": name, "object": "model", "created": created, "owned_by": "gaas", "root": name, "parent": None,
                "max_model_len": ctx, "ready_workers": ready, "permission": [],
                "versions": [{"version": v, "role": role} for v, role in sorted(versions.items())],
            }
            for name, ready, ctx, versions in models
        ] + [
            {
                "id": name, "object": "model", "created": created, "owned_by": "gaas", "root": name, "parent": base,
                "max_model_len": ctx, "ready_workers": ready, "permission": [],
            }
            for name, base, ready, ctx in adapters
        ],
    }
