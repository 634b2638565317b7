"""The rules of a GenerateRequest, shared by the router (the edge: the OpenAI parser reads its
ranges from here too) and the worker (defence in depth), with messages a caller can act on.
No grpc import: failures are gaas.contracts.errors.InvalidArgument naming the field.

Ranges follow vLLM 0.32's SamplingParams, so what GaaS accepts the engine accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from gaas.contracts.errors import InvalidArgument, quote
from gaas.v1 import common_pb2, inference_pb2

DEFAULT_MAX_TOKENS = 16
MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_TOKEN_LIST = 4096
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 64
MAX_PROMPT_CHARS = 1 << 20
MAX_MESSAGES = 256
MAX_MODEL_NAME = 256
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
ID_MAX = 128
LOGIT_BIAS_LIMIT = 100.0


@dataclass(frozen=True, slots=True)
class Range:
    lo: float
    hi: float
    # lo itself is refused (top_p 0, repetition_penalty 0).
    lo_open: bool = False

    def holds(self, value: float) -> bool:
        return (value > self.lo if self.lo_open else value >= self.lo) and value <= self.hi

    def describe(self) -> str:
        return f"{'above' if self.lo_open else 'at least'} {self.lo:g} and at most {self.hi:g}"


# The float sampling fields: their names are vLLM's and OpenAI's alike.
FLOAT_RANGES = {
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 100.0, lo_open=True),
}
TOP_K_MIN, TOP_K_MAX = -1, 2**31 - 1
# Below this temperature vLLM samples greedily (and then allows one choice only).
GREEDY_BELOW = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# vLLM's priority scheduling serves lower values first.
VLLM_PRIORITY = {
    common_pb2.PRIORITY_UNSPECIFIED: 1,
    common_pb2.PRIORITY_LOW: 2,
    common_pb2.PRIORITY_NORMAL: 1,
    common_pb2.PRIORITY_HIGH: 0,
}


def priority_class(priority: int) -> int:
    """A client's vLLM priority (any integer, lower served first) as GaaS's three classes (the
    tenant's tier bounds them)."""
    return common_pb2.PRIORITY_HIGH if priority < 0 else common_pb2.PRIORITY_LOW if priority > 0 else \
        common_pb2.PRIORITY_NORMAL


def _invalid(param: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"'{param}' {message}", param=param)


def check_float(name: str, value: float) -> float:
    r = FLOAT_RANGES[name]
    if not r.holds(value):
        raise _invalid(name, f"must be {r.describe()}, got {quote(value)}")
    return value


def check_token_ids(name: str, ids, vocab_size: int | None) -> None:
    if len(ids) > MAX_TOKEN_LIST:
        raise _invalid(name, f"holds {len(ids)} token ids; at most {MAX_TOKEN_LIST} are accepted")
    if vocab_size:
        for t in ids:
            if t >= vocab_size:
                raise InvalidArgument(
                    f"'{name}' holds {t}, which is not a token id of this model (its vocabulary has {vocab_size})",
                    param=name,
                )


def structured_dict(so: common_pb2.StructuredOutput) -> dict | None:
    """A request's output constraint as vLLM's StructuredOutputsParams fields (None: none)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return {"json": so.json_schema}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        if not so.choice.choices:
            raise _invalid("structured_outputs.choice", "must hold at least one choice")
        return {"choice": list(so.choice.choices)}
    return {kind: getattr(so, kind)}


def sampling_dict(sp: common_pb2.SamplingParams, vocab_size: int | None = None) -> dict:
    """The sampling fields the caller set, under vLLM's names, after range checks."""
    out: dict = {}
    for name in FLOAT_RANGES:
        if sp.HasField(name):
            out[name] = check_float(name, getattr(sp, name))
    if sp.HasField("top_k"):
        if not TOP_K_MIN <= sp.top_k:
            raise _invalid("top_k", f"must be -1 or 0 (all tokens) or a positive number, got {sp.top_k}")
        out["top_k"] = sp.top_k
    if sp.HasField("seed"):
        out["seed"] = sp.seed
    if sp.HasField("min_tokens"):
        out["min_tokens"] = sp.min_tokens
    if sp.ignore_eos:
        out["ignore_eos"] = True
    if sp.stop_token_ids:
        check_token_ids("stop_token_ids", sp.stop_token_ids, vocab_size)
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.HasField("skip_special_tokens"):
        out["skip_special_tokens"] = sp.skip_special_tokens
    if sp.HasField("spaces_between_special_tokens"):
        out["spaces_between_special_tokens"] = sp.spaces_between_special_tokens
    if sp.include_stop_str_in_output:
        out["include_stop_str_in_output"] = True
    if sp.logit_bias:
        if len(sp.logit_bias) > MAX_LOGIT_BIAS:
            raise _invalid("logit_bias", f"holds {len(sp.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are accepted")
        check_token_ids("logit_bias", sorted(sp.logit_bias), vocab_size)
        # Clamped as vLLM's OpenAI server does.
        out["logit_bias"] = {
            t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, b)) for t, b in sp.logit_bias.items() if b == b
        }
    if sp.allowed_token_ids:
        check_token_ids("allowed_token_ids", sp.allowed_token_ids, vocab_size)
        out["allowed_token_ids"] = list(sp.allowed_token_ids)
    if sp.bad_words:
        if len(sp.bad_words) > MAX_BAD_WORDS:
            raise _invalid("bad_words", f"holds {len(sp.bad_words)} words; at most {MAX_BAD_WORDS} are accepted")
        if any(not w or len(w) > MAX_STOP_LENGTH for w in sp.bad_words):
            raise _invalid("bad_words", f"entries must be 1 to {MAX_STOP_LENGTH} characters")
        out["bad_words"] = list(sp.bad_words)
    return out


class ContextTooLong(InvalidArgument):
    """The prompt and the completion asked for do not fit the model's context (a session turn
    shortens its context and tries again)."""

    def __init__(self, message: str, *, param: str, prompt_tokens: int) -> None:
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens


def no_room_error(max_model_len: int, prompt_tokens: int, what: str) -> ContextTooLong:
    """A prompt (what: "prompt") or conversation ("messages") that leaves no room for a reply."""
    noun = "the conversation" if what == "messages" else "the prompt"
    return ContextTooLong(
        f"{noun} is {prompt_tokens} tokens, which leaves no room for a reply in the model's context of "
        f"{max_model_len} tokens: shorten {noun}", param=what, prompt_tokens=prompt_tokens,
    )


def context_error(max_model_len: int, prompt_tokens: int, max_tokens: int, what: str) -> ContextTooLong:
    return ContextTooLong(
        f"this model's maximum context length is {max_model_len} tokens, but the request needs "
        f"{prompt_tokens + max_tokens} ({prompt_tokens} in the {what}, {max_tokens} in the completion): shorten the "
        f"{what} or lower max_tokens",
        param="max_tokens", prompt_tokens=prompt_tokens,
    )


def check(req: inference_pb2.GenerateRequest, max_model_len: int | None = None, vocab_size: int | None = None) -> int:
    """Validate req; returns the effective max_tokens (0 for messages without one: the worker
    gives them the rest of the context once the conversation is rendered)."""
    if sum(map(bool, (req.prompt, req.prompt_token_ids, req.messages))) != 1:
        raise InvalidArgument("set exactly one of prompt (text), prompt_token_ids and messages", param="prompt")
    if len(req.model) > MAX_MODEL_NAME:
        raise _invalid("model", f"is {len(req.model)} characters; model names are at most {MAX_MODEL_NAME}")
    chars = len(req.prompt) + sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in req.messages)
    if chars > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"the prompt is {chars} characters; the limit is {MAX_PROMPT_CHARS}", param="prompt")
    if len(req.messages) > MAX_MESSAGES:
        raise _invalid("messages", f"holds {len(req.messages)} messages; at most {MAX_MESSAGES} are accepted")
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, got {quote(m.role)}", param="messages"
            )
    if req.session_id and (req.tools or any(m.tool_calls or m.role == "tool" for m in req.messages)):
        raise InvalidArgument(
            "a session keeps text turns only: send a conversation with tools or tool calls whole, without session_id",
            param="session_id")
    if (req.tools or req.tool_calling.mode) and req.prompt:
        raise InvalidArgument("tools are for chat messages, not a text prompt", param="tools")
    if req.continue_final_message and (not req.messages or req.add_generation_prompt):
        raise InvalidArgument(
            "continue_final_message needs messages and add_generation_prompt false", param="continue_final_message"
        )
    if vocab_size and req.prompt_token_ids and max(req.prompt_token_ids) >= vocab_size:  # (the loop only to name it)
        for i, t in enumerate(req.prompt_token_ids):
            if t >= vocab_size:
                raise InvalidArgument(
                    f"'prompt[{i}]' is {t}, not a token id of this model (its vocabulary has {vocab_size})", param="prompt"
                )
    max_tokens = req.max_tokens or (0 if req.messages else DEFAULT_MAX_TOKENS)
    if max_model_len is not None:
        if max_tokens >= max_model_len:
            raise _invalid("max_tokens", f"is {max_tokens}; it must be below the model's context of {max_model_len} tokens")
        if req.prompt_token_ids and len(req.prompt_token_ids) + max_tokens > max_model_len:
            raise context_error(max_model_len, len(req.prompt_token_ids), max_tokens, "prompt")
    if req.n > MAX_N:
        raise _invalid("n", f"is {req.n}; at most {MAX_N} choices per prompt are generated")
    if req.n > 1 and req.sampling.HasField("temperature") and req.sampling.temperature < GREEDY_BELOW:
        raise _invalid("n", "must be 1 with greedy sampling (temperature 0): every choice would be the same")
    if req.HasField("logprobs") and req.logprobs > MAX_LOGPROBS:
        raise _invalid("logprobs", f"is {req.logprobs}; at most {MAX_LOGPROBS} alternatives per token are returned")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"holds {len(req.stop)} strings; at most {MAX_STOP_STRINGS} are accepted")
    for s in req.stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise _invalid("stop", f"strings must be 1 to {MAX_STOP_LENGTH} characters")
    if req.priority not in VLLM_PRIORITY:
        raise _invalid("priority", f"{req.priority} is not a priority (PRIORITY_LOW, _NORMAL or _HIGH)")
    if len(req.request_id) > ID_MAX:
        raise _invalid("request_id", f"is at most {ID_MAX} characters")
    if len(req.session_id) > ID_MAX:
        raise _invalid("session_id", f"is at most {ID_MAX} characters")
    sampling_dict(req.sampling, vocab_size)
    if req.sampling.HasField("min_tokens") and max_tokens and req.sampling.min_tokens > max_tokens:
        raise _invalid("min_tokens", f"({req.sampling.min_tokens}) must not exceed max_tokens ({max_tokens})")
    return max_tokens
