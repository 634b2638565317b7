"""Stage 3, prepare (services/router/prepare.py), with the directory and tokenizer faked: the prompt
tokenized once and checked against the model's window, the cache salt (the tenant's, or a public
prefix's with its cap on cached tokens), the prompt's blocks looked up in the router's own replica of
the KV directory, and a model that scales from zero passed on when the ingress waits."""

import re
import time

import pytest

from gaas.contracts import errors, genrequest, kvhash
from gaas.contracts.principal import Principal
from gaas.v1 import inference_pb2
from services.router.directory import ModelEntry
from services.router.prepare import ScalingUp
from services.router.scheduling import Candidate, WorkerId
from tests.unit.router import support
from tests.unit.router.support import OK, FakeWorkers

ACME = Principal("acme", "gold", "key_1", "salt-acme")


def prepare(d, **req):
    return d.preparer.prepare(inference_pb2.GenerateRequest(**req), ACME)


async def test_the_prompt_is_tokenized_once_and_the_worker_gets_only_its_token_ids():
    d = support.stages(("w0",))
    p = await prepare(d, model="tiny", prompt="hello", max_tokens=4)
    # FakeTokenizer: a special token, then one token per character.
    assert p.prompt_tokens == 6 and len(p.request.prompt_token_ids) == 6
    assert not p.request.prompt and not p.request.messages and p.request.model == "tiny"
    assert p.cache_salt == "salt-acme" and p.cached_cap is None


async def test_a_chat_without_max_tokens_may_fill_the_models_window():
    d = support.stages(("w0",))
    p = await prepare(d, messages=[inference_pb2.ChatMessage(role="user", content="hi")])
    assert p.request.max_tokens == 64 - p.prompt_tokens


@pytest.mark.parametrize("prompt, max_tokens, error", [
    ("x" * 70, 4, "leaves no room for a reply"),
    ("x" * 40, 40, "maximum context length is 64 tokens"),
])
async def test_a_request_past_the_models_window_is_refused_saying_what_to_shorten(prompt, max_tokens, error):
    d = support.stages(("w0",))
    with pytest.raises(genrequest.ContextTooLong, match=error):
        await prepare(d, prompt=prompt, max_tokens=max_tokens)


async def test_a_prompt_under_a_public_prefix_is_salted_with_it_and_caps_its_cached_tokens():
    models = [ModelEntry("tiny", "1.0", 64, True, public_prefixes=(("faq", "You are helpful."),))]
    d = support.stages(models=models, candidates=[Candidate(WorkerId("w0"), "w0:1", "tiny", "1.0", 64)])
    p = await prepare(d, prompt="You are helpful. What is 2+2?", max_tokens=4)
    assert p.cache_salt == kvhash.public_salt("faq")
    assert p.cached_cap == 1 + len("You are helpful.")  # the prefix's own tokens, its special one too
    mine = await prepare(d, prompt="Something else", max_tokens=4)
    assert mine.cache_salt == "salt-acme" and mine.cached_cap is None


async def test_a_model_nobody_serves_is_refused_before_it_is_tokenized():
    d = support.stages(candidates=[Candidate(WorkerId("w0"), "w0:1", "other", "1.0", 64)],
                       models=[ModelEntry("tiny", "1.0", 64, True), ModelEntry("other", "1.0", 64, False)])
    with pytest.raises(errors.Unavailable, match="'tiny' is deployed with no workers"):
        await prepare(d, model="tiny", prompt="hi", max_tokens=4)


async def test_an_autoscaled_model_with_no_worker_is_passed_on_when_the_ingress_waits():
    class Marks:
        def __init__(self):
            self.marked = []

        async def mark(self, model):
            self.marked.append(model)

    models = [ModelEntry("tiny", "1.0", 64, True, autoscaled=True), ModelEntry("other", "1.0", 64, False)]
    demand = Marks()
    d = support.stages(models=models, candidates=[Candidate(WorkerId("w0"), "w0:1", "other", "1.0", 64)], demand=demand)
    with pytest.raises(ScalingUp):
        await d.preparer.prepare(inference_pb2.GenerateRequest(model="tiny", prompt="hi", max_tokens=4), ACME,
                                 for_ingress=True)
    assert demand.marked == ["tiny"]  # its autoscaler is told


class HeldKV:
    """KVDirectoryClient stand-in: w1 holds every block."""

    def __init__(self):
        self.asked = []  # the hashes of each lookup
        self.provisioned = []

    def lookup(self, hashes):
        from services.router.kvreplica import PrefixMatch

        self.asked.append(list(hashes))
        return PrefixMatch({WorkerId("w1"): len(hashes)}, {WorkerId("w1"): len(hashes)})

    def provision(self, worker, hashes, owner, best_matched=0):
        self.provisioned.append((worker, len(hashes), best_matched))


async def _prepared(workers, kv):
    cands = [Candidate(WorkerId(w), w, "tiny", "1.0", 4096, block_size=64) for w in workers]
    fake = FakeWorkers({w: OK for w in workers})
    stages = support.stages(candidates=cands, max_model_len=4096, workers_stub=fake, scheduler="kv_aware", retries=0,
                            kv=kv)
    principal = ACME
    prepared = await stages.preparer.prepare(
        inference_pb2.GenerateRequest(prompt_token_ids=list(range(1, 200)), max_tokens=4), principal)
    return stages, fake, principal, prepared


async def test_the_kv_lookup_is_made_in_process_as_the_prompt_is_prepared_and_routes_where_the_prefix_is():
    kv = HeldKV()
    stages, workers, principal, prepared = await _prepared(("w0", "w1"), kv)
    assert len(prepared.block_hashes) == 3 and prepared.prefix.matched == {"w1": 3} and len(kv.asked) == 1
    chunks = [c async for c in stages.relay.stream(prepared, principal, "req-x", None, time.perf_counter())]
    assert [c.text for c in chunks] == ["a", "b"]
    assert [a for a, _ in workers.calls] == ["w1"]  # routed where the prefix is
    assert kv.provisioned == [("w1", 3, 3)]


async def test_with_one_worker_the_kv_directory_is_not_asked():
    kv = HeldKV()
    stages, _, principal, prepared = await _prepared(("w0",), kv)
    assert prepared.prefix is None and kv.asked == []
    chunks = [c async for c in stages.relay.stream(prepared, principal, "req-y", None, time.perf_counter())]
    assert [c.text for c in chunks] == ["a", "b"]
    assert kv.provisioned == []  # nothing to predict for: the engine's events tell the directory


def embed(*inputs, model="embedder"):
    r = inference_pb2.GenerateRequest(model=model)
    for i in inputs:
        r.embed.inputs.add(**({"text": i} if isinstance(i, str) else {"token_ids": i}))
    return r


EMBEDDER = [ModelEntry("tiny", "1.0", 64, True), ModelEntry("embedder", "1.0", 64, False, task="embed")]


def embedding_stages():
    return support.stages(models=EMBEDDER, candidates=[Candidate(WorkerId("w0"), "w0:1", "tiny", "1.0", 64),
                                                       Candidate(WorkerId("w1"), "w1:1", "embedder", "1.0", 64)])


async def test_an_embeddings_request_sends_the_worker_each_inputs_token_ids_and_counts_them_all():
    d = embedding_stages()
    p = await d.preparer.prepare(embed("hi", [5, 6, 7]), ACME)
    assert [list(i.token_ids) for i in p.request.embed.inputs] == [[0, 1 + ord("h"), 1 + ord("i")], [5, 6, 7]]
    assert p.prompt_tokens == 6 and p.request.max_tokens == 0 and not p.request.prompt_token_ids


@pytest.mark.parametrize("request_, says", [
    (embed("x" * 70), "'input[0]' is 71 tokens; 'embedder' embeds at most 64 tokens per input"),
    (embed([5], [999_999]), "'input[1]' holds token id 999999"),
    (embed("x", model="tiny"), "model 'tiny' serves completions and chats"),
    (inference_pb2.GenerateRequest(model="embedder", prompt="hi", max_tokens=2), "model 'embedder' serves embeddings"),
])
async def test_a_request_an_embedding_model_or_its_window_cannot_take_is_refused_naming_it(request_, says):
    d = embedding_stages()
    with pytest.raises(errors.InvalidArgument, match=re.escape(says)):
        await d.preparer.prepare(request_, ACME)
