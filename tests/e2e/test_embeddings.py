"""Embeddings on a live mesh of its own: gaas-tiny generating beside gaas-embed, the same weights
served by vLLM's pooling runner (engine: {task: embed}), one worker each. The official openai client
gets each input's vector (float and base64, text and token ids) equal to the model's own (its last
token's final hidden state, normalized: what vLLM's conversion computes, here by transformers); the
ledger holds exactly the prompt tokens the client was told; a model asked for what it does not serve
and a malformed body are 400s in OpenAI's shape; /v1/models says what each model serves."""

from __future__ import annotations

import re

import numpy as np
import openai
import pytest

from bench.common.mesh import tiny_deployment
from gaas.sdk.admin import BillingAdmin
from tests.conftest import INGRESS_PATH, ROOT, on_direct_path
from tests.e2e.support import instance, new_tenant
from tests.meshutil import openai_client, own_mesh
from tests.waiting import eventually

pytestmark = [pytest.mark.mesh,
              on_direct_path("the router serves /v1/embeddings on either path (the ingress's transcoder passes it "
                             "there, as it does the Responses API): once per suite, CI's budget")]
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
