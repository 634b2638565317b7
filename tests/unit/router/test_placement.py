"""Stage 5, place (services/router/placement.py), with the directory and tokenizer faked: the
request counted in flight where it goes, what the worker is sent, and the second choice the
ingress is given on the direct path."""

from dataclasses import replace

from gaas.contracts import batches as batch_terms, qos
from gaas.contracts.adapters import Adapter
from gaas.contracts.principal import Principal
from gaas.contracts.rollout import Split
from gaas.v1 import inference_pb2
from services.router.directory import ModelEntry, VersionEntry
from services.router.scheduling import Candidate, WorkerId
from tests.unit.router import support

ACME = Principal("acme", "gold", "key_1", "salt-acme")


async def placed(d, principal=ACME, request_id="req-1", **req):
    request = inference_pb2.GenerateRequest(model="tiny", prompt="hi", max_tokens=4, **req)
    prepared = await d.preparer.prepare(request, principal)
    return await d.placer.place_direct(prepared, principal, request_id, None)


async def test_a_placement_counts_the_request_in_flight_at_its_worker_until_it_ends():
    d = support.stages(("w0",))
    p = await placed(d)
    assert p.worker.worker_id == "w0" and d.in_flight == 1
    # A load report from before it cannot know it: the pre-cycle hook adds it to the worker's count.
    assert d.inflight.since(WorkerId("w0"), 0) == 1
    p.ended(None)
    assert d.in_flight == 0 and d.inflight.since(WorkerId("w0"), 0) == 0


async def test_the_worker_is_sent_token_ids_the_tenants_salt_and_its_tiers_engine_priority():
    d = support.stages(("w0",))
    p = await placed(d, priority=3)
    r = p.request
    assert r.request_id == "req-1" and r.cache_salt == "salt-acme"
    assert list(r.request.prompt_token_ids) and not r.request.prompt  # tokenized once, here
    assert r.engine_priority == qos.engine_priority("gold", 3)
    assert not r.HasField("adapter") and not r.stream_interval  # one token per message at this load


async def test_a_batch_item_streams_the_fewest_messages_and_an_adapter_is_named_to_the_worker():
    d = support.stages(("w0",))
    p = await placed(d, replace(ACME, batch=True))
    assert p.request.stream_interval == batch_terms.STREAM_INTERVAL
    lora = Adapter("acme-lora", "tiny", "/adapters/acme-lora", rank=8, owner="acme", adapter_id=7)
    prepared = await d.preparer.prepare(inference_pb2.GenerateRequest(model="tiny", prompt="hi", max_tokens=4), ACME)
    prepared.model = prepared.model.with_adapter(lora)
    sent = d.placer.worker_request(prepared, ACME, "req-2")
    assert (sent.adapter.name, sent.adapter.adapter_id, sent.adapter.path) == ("acme-lora", 7, "/adapters/acme-lora")


async def test_the_ingress_is_given_the_best_other_worker_as_second_choice():
    d = support.stages(("w0", "w1", "w2"))
    p = await placed(d)
    assert p.fallback is not None and p.fallback.worker_id != p.worker.worker_id
    assert p.addresses == f"{p.worker.address},{p.fallback.address}"
    assert {w.worker_id for w in p.others} == {"w0", "w1", "w2"} - {p.worker.worker_id}


async def test_a_worker_whose_breaker_is_open_is_the_second_choice_only_when_there_is_no_other():
    d = support.stages(("w0", "w1", "w2"))
    for _ in range(5):
        d.flow.breakers.failure(WorkerId("w1"), "down")
    assert WorkerId("w1") in d.flow.breakers.blocked()
    p = await placed(d)
    assert p.worker.worker_id != "w1" and p.fallback.worker_id not in ("w1", p.worker.worker_id)
    d = support.stages(("w0", "w1"))
    for _ in range(5):
        d.flow.breakers.failure(WorkerId("w1"), "down")
    p = await placed(d)
    # Named all the same: the ingress's retry would otherwise reach any worker, which refuses it.
    assert p.worker.worker_id == "w0" and p.fallback.worker_id == "w1" and p.addresses == "w0:1,w1:1"
    assert p.others == []  # (no stream is carried on at it)


async def test_a_version_with_one_worker_names_a_worker_of_the_other_version_second():
    models = [ModelEntry("tiny", "1.0", 64, True,
                         versions={"1.0": VersionEntry("", 64), "2.0": VersionEntry("", 64, "canary")},
                         split=Split("tiny", stable="1.0", canary="2.0", weight=50))]
    cands = [Candidate(WorkerId("w0"), "w0:1", "tiny", "1.0", 64), Candidate(WorkerId("w1"), "w1:1", "tiny", "2.0", 64)]
    d = support.stages(models=models, candidates=cands)
    seen = set()
    for i in range(8):
        p = await placed(d, request_id=f"req-{i}")
        # The canary's only worker draining or full: the stable version serves it, and the reverse.
        assert p.fallback is not None and p.fallback.worker_id != p.worker.worker_id, p.addresses
        assert p.others == []  # a stream is carried on within its version only
        seen.add(p.worker.worker_id)
        p.ended(None)
    assert seen == {"w0", "w1"}
