"""vLLM's score and rerank APIs for a model that embeds (a bi-encoder, as vLLM's server serves them
for such a model): POST /score and /v1/score (queries against documents), POST /rerank, /v1/rerank and
/v2/rerank (Jina's and Cohere's shape: one query, its documents ranked). A body is read strictly into a
ScoreRequest; its texts are embedded as one engine request (the queries, then the documents), and
each pair's score is the cosine similarity of their vectors, as vLLM computes it. Pure functions, no
I/O; failures are gaas.contracts.errors.InvalidArgument.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gaas.contracts import genrequest
from gaas.contracts.errors import InvalidArgument
from gaas.contracts.jsonbody import INT64_MAX, INT64_MIN, Fields, type_name
from gaas.openai import embeddings
from gaas.openai.embeddings import EmbeddingRequest

# What vLLM's server calls the two sides of /score, each pair of names one way to write a request.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
# Fields vLLM's scoring requests know that GaaS accepts only at their default: (test, what GaaS lacks).
_ONLY_DEFAULT = {
    "truncate_prompt_tokens": (lambda v: False, "texts are never truncated"),
    "truncation_side": (lambda v: False, "texts are never truncated"),
    "max_tokens_per_query": (lambda v: v == 0, "texts are never truncated"),
    "max_tokens_per_doc": (lambda v: v == 0, "texts are never truncated"),
    "padding": (lambda v: v == "do_not_pad", "texts are not padded"),
    "use_activation": (lambda v: False, "a bi-encoder's score is its vectors' cosine"),
    "instruction": (lambda v: False, "a bi-encoder embeds each text alone, with no template"),
    "chat_template_kwargs": (lambda v: v == {}, "a bi-encoder embeds each text alone, with no template"),
    "mm_processor_kwargs": (lambda v: v == {}, "no multimodal input"),
    "cache_salt": (lambda v: False, "GaaS salts each tenant's prefix cache itself"),
}


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    model: str
    # One query scored against every document, or as many queries as documents (pairs in order).
    queries: tuple[str, ...]
    documents: tuple[str, ...]
    # Answered as a ranking (/rerank: sorted by score, the best top_n) or as scores in order (/score).
    rerank: bool = False
    # The best this many (0: all), for a ranking.
    top_n: int = 0
    # Whether each ranked result carries its document's text (Cohere's return_documents).
    return_documents: bool = True
    priority: int = 0
    client_request_id: str = ""


def parse_score(body: dict) -> ScoreRequest:
    """The body of POST /score: queries and documents under any of vLLM's pairs of names."""
    f = Fields(body)
    given = [pair for pair in SCORE_SIDES if pair[0] in f.body and pair[1] in f.body]
    if len(given) != 1:
        names = ", ".join(f"'{a}' and '{b}'" for a, b in SCORE_SIDES)
        raise InvalidArgument(f"a score request names its two sides one way, one of: {names}", param="queries")
    first, second = given[0]
    queries, documents = _texts(f, first), _texts(f, second)
    if len(queries) > 1 and len(queries) != len(documents):
        raise InvalidArgument(f"'{first}' holds {len(queries)} texts and '{second}' {len(documents)}: give one "
                              f"{first[:-1] if first.endswith('s') else first} for all, or one per entry (1:N or "
                              "N:N)", param=first)
    return _finish(f, ScoreRequest(_model(f), queries, documents))


def parse_rerank(body: dict) -> ScoreRequest:
    """The body of POST /rerank (and /v1, /v2): one query, its documents, the best top_n."""
    f = Fields(body)
    query = _texts(f, "query")
    if len(query) != 1:
        raise InvalidArgument("'query' must be one string", param="query")
    documents = _texts(f, "documents")
    top_n = f.integer("top_n", 0, INT64_MAX) or 0
    keep = f.boolean("return_documents")
    r = ScoreRequest(_model(f), query, documents, rerank=True, top_n=top_n, return_documents=keep is not False)
    return _finish(f, r)


def _model(f: Fields) -> str:
    model = f.string("model", genrequest.MAX_MODEL_NAME)
    if not model:
        raise InvalidArgument("'model' is required: the name of an embedding model (GET /v1/models lists them)",
                              param="model")
    return model


def _texts(f: Fields, name: str) -> tuple[str, ...]:
    raw = f.raw(name)
    if raw is None:
        raise f.fail(name, "is required: a string or an array of strings")
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise f.fail(name, "must hold at least one text")
    if len(items) > embeddings.MAX_INPUTS:
        raise f.fail(name, f"holds {len(items)} texts; at most {embeddings.MAX_INPUTS} are accepted in one request")
    for i, item in enumerate(items):
        if isinstance(item, dict) and "content" in item:
            raise InvalidArgument(f"'{name}[{i}]' is multimodal content; this model reads text only: send a string",
                                  param=name)
        if not isinstance(item, str) or not item:
            raise InvalidArgument(f"'{name}[{i}]' must be a non-empty string, not "
                                  f"{'an empty one' if item == '' else type_name(item)}", param=name)
        if len(item) > embeddings.MAX_INPUT_CHARS:
            raise InvalidArgument(f"'{name}[{i}]' is {len(item)} characters; at most {embeddings.MAX_INPUT_CHARS} "
                                  "are accepted", param=name)
    return tuple(items)


def _finish(f: Fields, r: ScoreRequest) -> ScoreRequest:
    if len(r.queries) + len(r.documents) > embeddings.MAX_INPUTS:
        raise InvalidArgument(f"the request holds {len(r.queries) + len(r.documents)} texts; at most "
                              f"{embeddings.MAX_INPUTS} are accepted in one request", param="documents")
    priority = f.integer("priority", INT64_MIN, INT64_MAX) or 0
    f.string("user", embeddings.MAX_USER_CHARS)
    client_id = f.string("request_id", genrequest.ID_MAX) or ""
    for name, (accepted, what) in _ONLY_DEFAULT.items():
        f.only_default(name, accepted, what)
    f.finish()
    return ScoreRequest(r.model, r.queries, r.documents, r.rerank, r.top_n, r.return_documents, priority, client_id)


def embedding_request(r: ScoreRequest) -> EmbeddingRequest:
    """The texts to embed: the queries, then the documents (one engine request)."""
    return EmbeddingRequest(r.model, r.queries + r.documents, priority=r.priority,
                            client_request_id=r.client_request_id)


def scores(r: ScoreRequest, vectors: Sequence[bytes]) -> list[float]:
    """Each pair's cosine similarity, in the documents' order (vectors: the queries', then the
    documents', as embedding_request asked), as torch's cosine_similarity computes it (each norm at
    least 1e-8), in float64 (2,048 vectors are microseconds, not the event loop's time)."""
    n = len(r.queries)
    matrix = np.frombuffer(b"".join(vectors), dtype="<f4").reshape(len(vectors), -1).astype(np.float64)
    queries, documents = matrix[:n], matrix[n:]
    if n == 1:
        queries = np.broadcast_to(queries, documents.shape)
    dots = np.einsum("ij,ij->i", queries, documents)
    norms = np.maximum(np.linalg.norm(queries, axis=1), 1e-8) * np.maximum(np.linalg.norm(documents, axis=1), 1e-8)
    return (dots / norms).tolist()


def answer_json(r: ScoreRequest, request_id: str, model: str, scored: Sequence[float], prompt_tokens: int,
                created: int | None = None) -> bytes:
    """The answer in vLLM's shape: scores in order (/score), or the documents ranked (/rerank)."""
    if not r.rerank:
        answer: dict = {
            "id": request_id, "object": "list", "created": int(time.time()) if created is None else created,
            "model": model, "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}
    else:
        ranked = sorted(range(len(scored)), key=lambda i: scored[i], reverse=True)
        if 0 < r.top_n < len(ranked):
            ranked = ranked[:r.top_n]
        results = [{"index": i, "document": {"text": r.documents[i], "multi_modal": None} if r.return_documents
                    else None, "relevance_score": scored[i]} for i in ranked]
        answer = {"id": request_id, "model": model, "usage": {"prompt_tokens": prompt_tokens,
                                                               "total_tokens": prompt_tokens},
                  "results": results}
    return json.dumps(answer, separators=(",", ":")).encode()
