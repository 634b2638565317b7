"""The HTTP API of vLLM's OpenAI-compatible server, translated: request bodies to GenerateRequests
(strictly: each field's type and range is checked, unknown fields are refused, and what GaaS
cannot honour is refused with a 400 naming it, never silently ignored), and the model list. The
answers, in the shapes vLLM answers with, are stream.py's. Pure functions, no I/O and no gRPC;
failures are gaas.contracts.errors.InvalidArgument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gaas.contracts import edge, genrequest
from gaas.contracts.errors import InvalidArgument, quote
from gaas.contracts.jsonbody import INT64_MAX, INT64_MIN, UINT32_MAX, Fields, int_items, is_digits, type_name
from gaas.openai import outputs
from gaas.v1 import common_pb2, inference_pb2

MAX_PROMPTS = 64
MAX_CHOICES = 64
MAX_USER_CHARS = 256


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
        req.priority = genrequest.priority_class(priority)
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


@dataclass(frozen=True, slots=True)
class ListedModel:
    name: str
    ready_workers: int
    max_model_len: int
    # Version -> its role (stable, canary or kept), for the versions with workers.
    versions: dict[str, str]
    # ready, starting or scaled_to_zero.
    state: str
    # What it serves: generate or embed (gaas.contracts.tasks).
    task: str = "generate"


def models_list(models: list[ListedModel], created: int, adapters: list[tuple[str, str, int, int]] = ()) -> dict:
    """models shaped as vLLM's model cards (versions, state and task: GaaS's own fields); adapters:
    (name, base model, ready workers, context length) of the LoRA adapters the caller may use, as
    vLLM lists its LoRA modules (parent: the base model)."""
    return {
        "object": "list",
        "data": [
            {
                "id": m.name, "object": "model", "created": created, "owned_by": "gaas", "root": m.name,
                "parent": None, "max_model_len": m.max_model_len, "ready_workers": m.ready_workers, "state": m.state,
                "task": m.task, "permission": [],
                "versions": [{"version": v, "role": role} for v, role in sorted(m.versions.items())],
            }
            for m in models
        ] + [
            {
                "id": name, "object": "model", "created": created, "owned_by": "gaas", "root": name, "parent": base,
                "max_model_len": ctx, "ready_workers": ready, "permission": [],
            }
            for name, base, ready, ctx in adapters
        ],
    }
