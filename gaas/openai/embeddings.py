"""OpenAI's embeddings API as vLLM's server answers it (POST /v1/embeddings, and vLLM's POST /pooling
of a model that embeds: the same request with a task): a request body read strictly into an
EmbeddingRequest (its inputs, text or token ids, one or a list; the encoding; the dimensions; the
user), and the answer written from the engine's vectors in vLLM's shape: float arrays, or base64 of
each vector's float32 bytes (little-endian, what the openai client decodes).

What vLLM's server accepts and GaaS cannot honour is refused with a 400 naming it, never silently
ignored. Pure functions, no I/O; failures are gaas.contracts.errors.InvalidArgument.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from gaas.contracts import genrequest
from gaas.contracts.errors import InvalidArgument
from gaas.contracts.jsonbody import INT64_MAX, INT64_MIN, UINT32_MAX, Fields, int_items, type_name
from gaas.v1 import inference_pb2

# Inputs in one request, and their tokens all together, at most (OpenAI's own limits).
MAX_INPUTS = 2048
MAX_TOKENS = 300_000
# Characters of one text input, at most (the tokens are counted against the model's length later).
MAX_INPUT_CHARS = 1 << 20
MAX_USER_CHARS = 256
ENCODINGS = ("float", "base64")

# Fields vLLM's server knows that GaaS accepts only at their default: (test, what GaaS lacks).
_ONLY_DEFAULT = {
    "truncate_prompt_tokens": (lambda v: False, "inputs are never truncated"),
    "truncation_side": (lambda v: False, "inputs are never truncated"),
    "padding": (lambda v: v == "do_not_pad", "inputs are not padded"),
    "embed_dtype": (lambda v: v == "float32", "vectors are float32"),
    "endianness": (lambda v: v in ("native", "little"), "base64 vectors are little-endian"),
    "use_activation": (lambda v: False, "the model's pooler decides its activation"),
    "normalize": (lambda v: False, "vLLM removed it for use_activation"),
    "messages": (lambda v: False, "embeddings of chat messages: send the text as input"),
    "mm_processor_kwargs": (lambda v: v == {}, "no multimodal input"),
    "cache_salt": (lambda v: False, "GaaS salts each tenant's prefix cache itself"),
}


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    # One entry per input: its text, or its token ids. The answer's data are in this order.
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    # The vector's length the client asked for (a model trained for it: Matryoshka); None: the model's.
    dimensions: int | None = None
    add_special_tokens: bool = True
    # vLLM's priority, as the client gave it (lower is served first; the tenant's tier bounds it).
    priority: int = 0
    # The id the client gave in the body (vLLM's request_id field), for the logs.
    client_request_id: str = ""
    # Asked at /pooling (answered as vLLM's pooling route answers: "object": "pooling", "data").
    pooling: bool = False


def parse_embedding(body: dict) -> EmbeddingRequest:
    """The body of POST /v1/embeddings, checked field by field as vLLM's server checks it."""
    return _parse(Fields(body), pooling=False)


def parse_pooling(body: dict) -> EmbeddingRequest:
    """The body of vLLM's POST /pooling for a model that embeds: an embeddings request whose task, if
    given, is "embed" (vLLM's other pooling tasks need models GaaS does not serve)."""
    f = Fields(body)
    task = f.string("task", 32)
    if task not in (None, "embed"):
        raise f.fail("task", f"must be \"embed\" (what GaaS's pooling models serve), got {task!r}")
    return _parse(f, pooling=True)


def _parse(f: Fields, pooling: bool) -> EmbeddingRequest:
    model = f.string("model", genrequest.MAX_MODEL_NAME)
    if not model:
        raise InvalidArgument("'model' is required: the name of an embedding model (GET /v1/models lists them)",
                              param="model")
    inputs = _inputs(f)
    encoding = f.string("encoding_format", 16)
    if encoding is not None and encoding not in ENCODINGS:
        raise f.fail("encoding_format", f"must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    dimensions = f.integer("dimensions", 1, UINT32_MAX)
    special = f.boolean("add_special_tokens")
    priority = f.integer("priority", INT64_MIN, INT64_MAX)
    f.string("user", MAX_USER_CHARS)
    client_id = f.string("request_id", genrequest.ID_MAX) or ""
    for name, (accepted, what) in _ONLY_DEFAULT.items():
        f.only_default(name, accepted, what)
    f.finish()
    return EmbeddingRequest(model, inputs, encoding or "float", dimensions, True if special is None else special,
                            priority or 0, client_id, pooling)


def _inputs(f: Fields) -> tuple[str | tuple[int, ...], ...]:
    """input: a string, an array of token ids, or a non-empty array of either (as OpenAI and vLLM
    take it: a flat array of integers is one input)."""
    raw = f.raw("input")
    if raw is None:
        raise InvalidArgument("'input' is required: a string, an array of strings, or token ids", param="input")
    if isinstance(raw, str):
        raw = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        what = "an empty array" if isinstance(raw, list) else type_name(raw)
        raise InvalidArgument(f"'input' must be a string or a non-empty array of strings or token ids, not {what}",
                              param="input")
    if len(raw) > MAX_INPUTS:
        raise InvalidArgument(f"'input' holds {len(raw)} inputs; at most {MAX_INPUTS} are accepted in one request",
                              param="input")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str) and item:
            if len(item) > MAX_INPUT_CHARS:
                raise InvalidArgument(f"'input[{i}]' is {len(item)} characters; at most {MAX_INPUT_CHARS} are "
                                      "accepted", param="input")
            out.append(item)
        elif isinstance(item, list) and item:
            out.append(tuple(int_items(item, f"input[{i}]", 0, UINT32_MAX, len(item))))
        else:
            raise InvalidArgument(f"'input[{i}]' must be a non-empty string or array of token ids, not "
                                  f"{'an empty one' if item in ('', []) else type_name(item)}", param="input")
    return tuple(out)


def engine_request(r: EmbeddingRequest) -> inference_pb2.GenerateRequest:
    """The engine request of an embeddings request: every input in it (one engine batch)."""
    req = inference_pb2.GenerateRequest(model=r.model, priority=genrequest.priority_class(r.priority),
                                        request_id=r.client_request_id)
    for item in r.inputs:
        if isinstance(item, str):
            req.embed.inputs.add(text=item)
        else:
            req.embed.inputs.add(token_ids=item)
    if r.dimensions is not None:
        req.embed.dimensions = r.dimensions
    req.embed.add_special_tokens = r.add_special_tokens
    return req


def vector_bytes(values: Sequence[float] | np.ndarray) -> bytes:
    """A vector as the engine's float32 values, little-endian (how chunks carry it)."""
    return np.asarray(values, dtype="<f4").tobytes()


def embeddings_json(request_id: str, model: str, vectors: Sequence[bytes], prompt_tokens: int, encoding: str,
                    created: int | None = None, pooling: bool = False) -> bytes:
    """The answer in vLLM's shape: one entry per input vector (float32 little-endian bytes), in
    order, and the usage (prompt tokens only); its id GaaS's request id's (req-X: embd-X, or pool-X
    for /pooling). pooling: as /pooling writes each entry.

    Float vectors are written as vLLM's server writes them (each float32 value as the shortest text of
    its double) by orjson, from numpy: 2,048 vectors of 1,024 floats are 0.15 s of the event loop's
    time, where the json module took 1.2 s."""
    data = []
    for i, raw in enumerate(vectors):
        if encoding == "base64":
            embedding: object = base64.b64encode(raw).decode("ascii")
        else:
            embedding = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        data.append({"index": i, "object": "pooling", "data": embedding} if pooling
                    else {"index": i, "object": "embedding", "embedding": embedding})
    answer = {"id": ("pool-" if pooling else "embd-") + request_id.removeprefix("req-"), "object": "list", "created": int(time.time()) if created is None else created,
              "model": model, "data": data,
              "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                        "prompt_tokens_details": None}}
    return orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
