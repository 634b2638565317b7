"""Embeddings on a live mesh of its own: gaas-tiny generating beside gaas-embed, the same weights
served by vLLM's pooling runner (engine: {task: embed}), one worker each. The official openai client
gets each input's vector (float and base64, text and token ids) equal to the model's own (its last
token's final hidden state, normalized: what vLLM's conversion computes, here by transformers); the
ledger holds exactly the prompt tokens the client was told; /pooling, /score and every rerank route
answer in vLLM's shapes with scores equal to the reference vectors' cosines; a model asked for what it
does not serve and a malformed body are 400s in OpenAI's shape; /v1/models says what each model
serves."""

from __future__ import annotations

from http.client import HTTPConnection
import io
import json
import re

import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from bench.common.mesh import tiny_deployment
from gaas.sdk.admin import BillingAdmin
from tests.conftest import INGRESS_PATH, ROOT
from tests.e2e.support import error_shaped, instance, new_tenant, send
from gaas.v1 import inference_pb2
from tests.meshutil import gaas, generate, http, openai_client, own_mesh
from tests.waiting import eventually

# (on both ingress paths: the direct path's worker answers /v1/embeddings itself, the router every
# other pooling route, and all of them on the router path)
pytestmark = pytest.mark.mesh
EMBED = "gaas-embed"
TEXTS = ["hello world", "the river runs down to the sea", "x"]


@pytest.fixture(scope="module")
def emesh(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("embed-mesh")
    deploy = run_dir / "deploy.yaml"
    deploy.write_text(tiny_deployment("replicas: 1") + f"""\
  - name: {EMBED}
    version: "1.0.0"
    source: models/gaas-tiny
    preset: tiny
    max_model_len: 2048
    replicas: 1
    engine: {{task: embed}}
""")
    with own_mesh(run_dir, port_start=24000, workers=2, ingress_path=INGRESS_PATH, args=("--deploy", str(deploy))) as m:
        yield m


@pytest.fixture(scope="module")
def reference():
    """The model's own vectors of a list of token id lists (transformers, on the same weights)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(ROOT / "models" / "gaas-tiny", dtype=torch.float32)

    def vectors(ids: list[list[int]]) -> list[np.ndarray]:
        with torch.no_grad():
            return [torch.nn.functional.normalize(model(torch.tensor([i])).last_hidden_state[0, -1], dim=0).numpy()
                    for i in ids]

    return vectors


def token_ids(texts: list[str]) -> list[list[int]]:
    from gaas.model.tokenizer import Tokenizer

    tok = Tokenizer.load(str(ROOT / "models" / "gaas-tiny"))
    return [tok.encode(t, True) for t in texts]


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_the_openai_client_gets_each_inputs_vector_equal_to_the_models_own(emesh, reference):
    c = openai_client(emesh)
    ids = token_ids(TEXTS)
    want = reference(ids)
    floats = c.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    decoded = c.embeddings.create(model=EMBED, input=TEXTS)  # (the client asks for base64 and decodes it)
    by_ids = c.embeddings.create(model=EMBED, input=ids)
    for answer in (floats, decoded, by_ids):
        assert answer.model == EMBED and [d.index for d in answer.data] == [0, 1, 2]
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
        for got, expected in zip(answer.data, want):
            assert len(got.embedding) == len(expected) and cosine(got.embedding, expected) >= 0.9999
    assert [d.embedding for d in decoded.data] == [d.embedding for d in floats.data]
    one = c.embeddings.create(model=EMBED, input="hello world", encoding_format="float")
    assert one.data[0].embedding == floats.data[0].embedding


def test_langchains_openai_embeddings_pointed_at_the_ingress_gets_the_same_vectors(emesh):
    from langchain_openai import OpenAIEmbeddings

    # (as vLLM's docs configure it for vLLM's server: texts sent as they are, not tiktoken's ids)
    lc = OpenAIEmbeddings(model=EMBED, base_url=f"http://{emesh.ingress}/v1", api_key=emesh.api_key,
                          check_embedding_ctx_length=False)
    want = [d.embedding for d in openai_client(emesh).embeddings.create(model=EMBED, input=TEXTS,
                                                                        encoding_format="float").data]
    got = lc.embed_documents(TEXTS)
    assert len(got) == 3 and all(cosine(g, w) >= 0.9999 for g, w in zip(got, want))
    assert cosine(lc.embed_query(TEXTS[1]), want[1]) >= 0.9999


def test_the_native_grpc_api_embeds_as_the_openai_route_does(emesh):
    request = inference_pb2.GenerateRequest(model=EMBED)
    for text in TEXTS:
        request.embed.inputs.add(text=text)
    (chunk,) = generate(emesh, **{f.name: v for f, v in request.ListFields()})
    want = [d.embedding for d in openai_client(emesh).embeddings.create(model=EMBED, input=TEXTS,
                                                                        encoding_format="float").data]
    got = [np.frombuffer(v, "<f4") for v in chunk.embeddings]
    assert len(got) == 3 and all(cosine(g, w) >= 0.9999 for g, w in zip(got, want))
    assert chunk.usage.prompt_tokens == sum(map(len, token_ids(TEXTS))) and chunk.usage.completion_tokens == 0


def test_the_ledger_holds_exactly_the_prompt_tokens_the_client_was_told(emesh):
    tenant, key = new_tenant(emesh, prefix="embed")
    c = openai_client(emesh, key)
    told = sum(c.embeddings.create(model=EMBED, input=TEXTS[:i + 1]).usage.prompt_tokens for i in range(3))

    def billed() -> dict | None:
        with BillingAdmin(instance(emesh, "billing-0"), emesh.run_dir) as b:
            total = b.usage(tenant)["total"]
        return total if total["requests"] >= 3 else None

    total = eventually(billed, 30, every=0.25, what=f"3 embeddings requests of {tenant} in the ledger")
    assert (total["requests"], total["prompt_tokens"], total["completion_tokens"]) == (3, told, 0)


def test_a_model_asked_for_what_it_does_not_serve_is_a_400_saying_what_it_serves(emesh):
    c = openai_client(emesh)
    with pytest.raises(openai.BadRequestError, match="serves completions and chats"):
        c.embeddings.create(model="gaas-tiny", input="hi")
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        c.completions.create(model=EMBED, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        c.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.mark.parametrize("given, says", [
    ([], "non-empty array"),
    ([""], "'input[0]' must be a non-empty string"),
    ([{"text": "x"}], "'input[0]' must be a non-empty string"),
    (["x"] * 2049, "at most 2048"),
    ([[5] * 2049], "embeds at most 2048 tokens per input"),
    ([[999_999]], "vocabulary"),
])
def test_a_malformed_input_is_a_400_in_openais_shape(emesh, given, says):
    with pytest.raises(openai.BadRequestError, match=re.escape(says)):
        openai_client(emesh).embeddings.create(model=EMBED, input=given, encoding_format="float")


def test_models_list_says_what_each_model_serves(emesh):
    listed = {m.id: m.task for m in openai_client(emesh).models.list().data}
    assert listed == {"gaas-tiny": "generate", EMBED: "embed"}
    shown = {m["name"]: m["task"] for m in json.loads(gaas(emesh, "models", "--json").stdout)}
    assert shown == listed, "`gaas models` says what each model serves too"


def post(mesh, path: str, body: dict) -> dict:
    status, text = http(mesh, path, json.dumps(body).encode())
    assert status == 200, text
    return json.loads(text)


QUERY = "where does the river go"


def test_scores_and_rankings_are_the_cosines_of_the_engines_vectors(emesh, reference):
    ids = token_ids([QUERY, *TEXTS])
    vectors = [d.embedding for d in openai_client(emesh).embeddings.create(model=EMBED, input=[QUERY, *TEXTS],
                                                                           encoding_format="float").data]
    want = [cosine(vectors[0], v) for v in vectors[1:]]
    # (the engine's vectors are the model's own to a cosine of 0.9999: their pairs' cosines to about 1e-3)
    assert want == pytest.approx([cosine(reference(ids[:1])[0], v) for v in reference(ids[1:])], abs=2e-3)
    tokens = sum(map(len, ids))
    for path in ("/score", "/v1/score"):
        scored = post(emesh, path, {"model": EMBED, "queries": QUERY, "documents": TEXTS})
        assert [d["index"] for d in scored["data"]] == [0, 1, 2] and scored["usage"]["prompt_tokens"] == tokens
        assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-5)
    order = sorted(range(3), key=lambda i: want[i], reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = post(emesh, path, {"model": EMBED, "query": QUERY, "documents": TEXTS, "top_n": 2})
        assert [r["index"] for r in ranked["results"]] == order[:2], path
        assert [r["document"]["text"] for r in ranked["results"]] == [TEXTS[i] for i in order[:2]]
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[i] for i in order[:2]],
                                                                                 abs=1e-5)
        assert ranked["usage"]["total_tokens"] == tokens


def test_pooling_answers_each_vector_as_vllms_pooling_route_does(emesh, reference):
    pooled = post(emesh, "/pooling", {"model": EMBED, "input": TEXTS, "task": "embed"})
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling"), (2, "pooling")]
    for got, expected in zip(pooled["data"], reference(token_ids(TEXTS))):
        assert cosine(got["data"], expected) >= 0.9999


@pytest.mark.parametrize("path, body, says", [
    ("/score", {"model": EMBED, "queries": ["a", "b"], "documents": ["c", "d", "e"]}, "1:N or N:N"),
    ("/v2/rerank", {"model": EMBED, "query": "q", "documents": []}, "at least one text"),
    ("/rerank", {"model": "gaas-tiny", "query": "q", "documents": ["d"]}, "serves completions and chats"),
    ("/pooling", {"model": EMBED, "input": "x", "task": "classify"}, "'task' must be"),
])
def test_a_wrong_score_rerank_or_pooling_request_is_a_400_in_openais_shape(emesh, path, body, says):
    status, text = http(emesh, path, json.dumps(body).encode())
    assert status == 400 and says in json.loads(text)["error"]["message"], text


def test_a_batch_of_embeddings_answers_each_line_as_v1_embeddings_would_billed_once_each(emesh):
    tenant, key = new_tenant(emesh, prefix="embed-batch")
    c = openai_client(emesh, key, timeout=120)
    rows = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": EMBED, "input": TEXTS[:i + 1], "encoding_format": "float"}} for i in range(3)]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"model": EMBED, "input": []}})
    f = c.files.create(file=("e.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    done = eventually(lambda: (x := c.batches.retrieve(b.id)).status in ("completed", "failed") and x, 120,
                      every=0.5, what=f"embeddings batch {b.id} finished")
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    out = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, c.files.content(done.output_file_id)
                                                              .text.splitlines())}
    direct = c.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    assert [d["embedding"] for d in out["e-2"]["data"]] == [d.embedding for d in direct.data]
    errors = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("bad", 400)]
    told = sum(out[f"e-{i}"]["usage"]["prompt_tokens"] for i in range(3)) + direct.usage.prompt_tokens

    def billed() -> dict | None:
        with BillingAdmin(instance(emesh, "billing-0"), emesh.run_dir) as adm:
            total = adm.usage(tenant)["total"]
        return total if total["requests"] >= 4 else None

    total = eventually(billed, 30, every=0.25, what=f"4 embeddings requests of {tenant} in the ledger")
    assert (total["requests"], total["prompt_tokens"]) == (4, told)


_anything = st.recursive(st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
                         | st.text(max_size=8) | st.sampled_from(["", "\ud800", "\x00", "x" * 5000]),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=3), max_leaves=6)
_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)
_texts = _text | st.lists(_text, min_size=1, max_size=3)
_fields = {
    "/v1/embeddings": {"input": _texts | st.lists(st.integers(0, 4095), min_size=1, max_size=5),
                       "encoding_format": st.sampled_from(["float", "base64", "binary"]),
                       "dimensions": st.integers(-1, 300)},
    "/pooling": {"input": _texts, "task": st.sampled_from(["embed", "classify", "token_embed"])},
    "/score": {"queries": _texts, "documents": _texts},
    "/v2/rerank": {"query": _texts, "documents": _texts, "top_n": st.integers(-1, 5),
                   "return_documents": st.booleans()},
}


@st.composite
def _pooling_body(draw):
    path = draw(st.sampled_from(sorted(_fields)))
    # (hypothesis draws small integers most: "== 3" is the rare case)
    rare = lambda n: draw(st.integers(0, n)) == n  # noqa: E731
    body = {"model": draw(_anything) if rare(7) else draw(st.sampled_from([EMBED] * 8 + ["gaas-tiny", "nope"]))}
    for name, valid in _fields[path].items():
        if not rare(4):
            body[name] = draw(_anything if rare(3) else valid)
    if rare(9):
        body[draw(st.sampled_from(["text_1", "items", "data_2", "user", "priority", "x"]))] = draw(_anything)
    raw = json.dumps(body).encode()
    return path, raw[:draw(st.integers(0, len(raw)))] if rare(9) else raw


@pytest.fixture(scope="module")
def econn(emesh):
    host, port = emesh.ingress.split(":")
    c = HTTPConnection(host, int(port), timeout=60)
    yield c
    c.close()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=_pooling_body())
def test_fuzz_embeddings_score_rerank_and_pooling_never_answer_5xx(emesh, econn, case):
    path, raw = case
    status, body = send(econn, "POST", path, raw, {"authorization": f"Bearer {emesh.api_key}",
                                                  "content-type": "application/json"})
    event(f"{path} HTTP {status}")
    if status != 200:
        error_shaped(status, body)
