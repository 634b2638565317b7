"""vLLM's score and rerank APIs for a model that embeds (gaas/openai/scores.py): each way vLLM names a
score request's two sides read alike, 1:N and N:N pairs and nothing else, every field checked with a
400 naming it, hostile bodies refused, never another exception; each pair scored by its vectors'
cosine as torch computes it; answers in vLLM's shapes, a ranking sorted and cut at top_n."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gaas.contracts import edge, errors, jsonbody
from gaas.openai.embeddings import MAX_INPUTS, vector_bytes
from gaas.openai.scores import answer_json, embedding_request, parse_rerank, parse_score, scores
from tests.hostile import at, fragments, splice


@pytest.mark.parametrize("first, second", [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                                           ("text_1", "text_2")])
def test_each_way_vllm_names_a_score_requests_sides_is_read_alike(first, second):
    r = parse_score({"model": "m", first: "q", second: ["a", "b"]})
    assert (r.model, r.queries, r.documents, r.rerank) == ("m", ("q",), ("a", "b"), False)
    assert embedding_request(r).inputs == ("q", "a", "b")


@pytest.mark.parametrize("body, param, says", [
    ({"model": "m", "queries": "q"}, "queries", "names its two sides one way"),
    ({"model": "m", "queries": "q", "documents": "a", "items": "b"}, "queries", "names its two sides one way"),
    ({"model": "m", "queries": ["q", "r"], "documents": ["a", "b", "c"]}, "queries", "1:N or N:N"),
    ({"model": "m", "queries": [], "documents": "a"}, "queries", "at least one text"),
    ({"model": "m", "queries": "q", "documents": [""]}, "documents", "'documents[0]' must be a non-empty string"),
    ({"model": "m", "queries": "q", "documents": [3]}, "documents", "not a number"),
    ({"model": "m", "queries": "q", "documents": [{"content": [{"type": "text", "text": "x"}]}]}, "documents",
     "multimodal"),
    ({"queries": "q", "documents": "a"}, "model", "'model' is required"),
    ({"model": "m", "queries": "q", "documents": "a", "max_tokens_per_doc": 5}, "max_tokens_per_doc", "truncated"),
    ({"model": "m", "queries": "q", "documents": "a", "instruction": "judge"}, "instruction", "no template"),
    ({"model": "m", "queries": "q", "documents": "a", "top_n": 1}, "top_n", "unknown field"),
    ({"model": "m", "queries": "q", "documents": ["a"] * MAX_INPUTS}, "documents", f"at most {MAX_INPUTS}"),
])
def test_a_wrong_score_request_is_a_400_naming_the_field(body, param, says):
    with pytest.raises(errors.InvalidArgument, match=re.escape(says)) as err:
        parse_score(body)
    assert err.value.param == param


def test_a_rerank_request_keeps_its_query_documents_and_top_n():
    r = parse_rerank({"model": "m", "query": "q", "documents": ["a", "b"], "top_n": 1, "return_documents": False,
                      "priority": -2, "request_id": "mine"})
    assert (r.queries, r.documents, r.rerank, r.top_n, r.return_documents, r.priority, r.client_request_id) == \
        (("q",), ("a", "b"), True, 1, False, -2, "mine")
    with pytest.raises(errors.InvalidArgument, match="'query' must be one string"):
        parse_rerank({"model": "m", "query": ["q", "r"], "documents": ["a"]})
    with pytest.raises(errors.InvalidArgument, match="'top_n' must be between 0"):
        parse_rerank({"model": "m", "query": "q", "documents": ["a"], "top_n": -1})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(path=st.sampled_from([("query",), ("documents",), ("documents", 0), ("model",), ("top_n",), ("user",),
                             ("return_documents",)]), fragment=fragments)
def test_hostile_values_are_refused_with_invalid_argument_never_another_exception(path, fragment):
    raw = splice(at(path, {"model": "m", "query": "q", "documents": ["x", "y"], "top_n": 1, "user": "u",
                           "return_documents": True}), fragment)
    try:
        parse_rerank(jsonbody.parse(raw, edge.MAX_BODY_BYTES * 2))
    except errors.InvalidArgument as err:
        assert err.message and len(err.message) <= errors.MAX_MESSAGE_CHARS


QUERY = np.array([0.3, -1.2, 2.0, 0.0], dtype=np.float32)
DOCS = [np.array(v, dtype=np.float32) for v in ([0.3, -1.2, 2.0, 0.1], [-1.0, 0.5, 0.25, 4.0], [0.0, 0.0, 0.0, 0.0])]


def torch_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return torch.nn.functional.cosine_similarity(torch.from_numpy(a), torch.from_numpy(b), dim=0).item()


def test_each_pair_scores_its_vectors_cosine_as_torch_computes_it():
    one_to_n = parse_score({"model": "m", "queries": "q", "documents": ["a", "b", "c"]})
    got = scores(one_to_n, [vector_bytes(v.tolist()) for v in [QUERY, *DOCS]])
    assert got == pytest.approx([torch_cosine(QUERY, d) for d in DOCS], abs=1e-6)
    n_to_n = parse_score({"model": "m", "queries": ["q", "r"], "documents": ["a", "b"]})
    got = scores(n_to_n, [vector_bytes(v.tolist()) for v in [QUERY, DOCS[1], DOCS[0], DOCS[0]]])
    assert got == pytest.approx([torch_cosine(QUERY, DOCS[0]), torch_cosine(DOCS[1], DOCS[0])], abs=1e-6)


def test_a_score_answer_is_vllms_shape_in_the_documents_order():
    r = parse_score({"model": "m", "queries": "q", "documents": ["a", "b"]})
    assert json.loads(answer_json(r, "score-1", "m", [0.25, 0.75], 6, created=7)) == {
        "id": "score-1", "object": "list", "created": 7, "model": "m",
        "data": [{"index": 0, "object": "score", "score": 0.25}, {"index": 1, "object": "score", "score": 0.75}],
        "usage": {"prompt_tokens": 6, "total_tokens": 6, "completion_tokens": 0, "prompt_tokens_details": None}}


def test_a_ranking_is_sorted_by_score_and_cut_at_top_n():
    r = parse_rerank({"model": "m", "query": "q", "documents": ["a", "b", "c"]})
    ranked = json.loads(answer_json(r, "rerank-1", "m", [0.1, 0.9, 0.5], 8))
    assert ranked == {"id": "rerank-1", "model": "m", "usage": {"prompt_tokens": 8, "total_tokens": 8},
                      "results": [{"index": i, "document": {"text": t, "multi_modal": None}, "relevance_score": s}
                                  for i, t, s in [(1, "b", 0.9), (2, "c", 0.5), (0, "a", 0.1)]]}
    top = parse_rerank({"model": "m", "query": "q", "documents": ["a", "b", "c"], "top_n": 1,
                        "return_documents": False})
    assert json.loads(answer_json(top, "rerank-1", "m", [0.1, 0.9, 0.5], 8))["results"] == [
        {"index": 1, "document": None, "relevance_score": 0.9}]
