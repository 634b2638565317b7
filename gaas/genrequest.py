"""Checks on a GenerateRequest shared by the router (the edge) and the worker (defence in depth),
with messages a caller can act on. No grpc import: callers map RequestInvalid to INVALID_ARGUMENT."""

from __future__ import annotations

from gaas.v1 import common_pb2, inference_pb2

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_PROMPT_CHARS = 1 << 20
MAX_MESSAGES = 256
CHAT_ROLES = ("system", "user", "assistant")
ID_MAX = 128

# vLLM's priority scheduling serves lower values first.
VLLM_PRIORITY = {
    common_pb2.PRIORITY_UNSPECIFIED: 1,
    common_pb2.PRIORITY_LOW: 2,
    common_pb2.PRIORITY_NORMAL: 1,
    common_pb2.PRIORITY_HIGH: 0,
}


class RequestInvalid(ValueError):
    """The request cannot be served as sent; str() says what to change."""


def sampling_dict(sp: common_pb2.SamplingParams) -> dict[str, float | int]:
    """The sampling fields the caller set, under vLLM's names, after range checks."""
    out: dict[str, float | int] = {}
    checks = {
        "temperature": (0.0, 100.0),
        "top_p": (1e-9, 1.0),
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
        "repetition_penalty": (1e-9, 100.0),
    }
    for name, (lo, hi) in checks.items():
        if sp.HasField(name):
            value = getattr(sp, name)
            if not lo <= value <= hi:
                raise RequestInvalid(f"sampling.{name} must be between {lo:g} and {hi:g}, got {value:g}")
            out[name] = value
    if sp.HasField("top_k"):
        if sp.top_k == 0 or sp.top_k < -1:
            raise RequestInvalid(f"sampling.top_k must be -1 (all tokens) or a positive number, got {sp.top_k}")
        out["top_k"] = sp.top_k
    if sp.HasField("seed"):
        out["seed"] = sp.seed
    return out


def check(req: inference_pb2.GenerateRequest, max_model_len: int | None = None) -> int:
    """Validate req; returns the effective max_tokens (0 for messages without one: the worker
    gives them the rest of the context once the conversation is rendered)."""
    if sum(map(bool, (req.prompt, req.prompt_token_ids, req.messages))) != 1:
        raise RequestInvalid("set exactly one of prompt (text), prompt_token_ids and messages")
    chars = len(req.prompt) + sum(len(m.content) for m in req.messages)
    if chars > MAX_PROMPT_CHARS:
        raise RequestInvalid(f"the prompt is {chars} characters; the limit is {MAX_PROMPT_CHARS}")
    if len(req.messages) > MAX_MESSAGES:
        raise RequestInvalid(f"at most {MAX_MESSAGES} messages, got {len(req.messages)}")
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise RequestInvalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}")
    max_tokens = req.max_tokens or (0 if req.messages else DEFAULT_MAX_TOKENS)
    if max_model_len is not None:
        if max_tokens >= max_model_len:
            raise RequestInvalid(f"max_tokens {max_tokens} must be below the model's context of {max_model_len} tokens")
        if len(req.prompt_token_ids) + max_tokens > max_model_len:
            raise RequestInvalid(
                f"prompt_token_ids ({len(req.prompt_token_ids)}) + max_tokens ({max_tokens}) exceed the model's "
                f"context of {max_model_len} tokens"
            )
    if len(req.stop) > MAX_STOP_STRINGS:
        raise RequestInvalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    for s in req.stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise RequestInvalid(f"stop strings must be 1 to {MAX_STOP_LENGTH} characters")
    if req.priority not in VLLM_PRIORITY:
        raise RequestInvalid(f"unknown priority {req.priority}")
    if len(req.request_id) > ID_MAX or len(req.session_id) > ID_MAX:
        raise RequestInvalid(f"request_id and session_id are at most {ID_MAX} characters")
    sampling_dict(req.sampling)
    return max_tokens
