"""The router's servicer over a real gRPC server, with the control plane and the workers faked
behind their interfaces: authentication, picking, retrying before the first token, never after,
error codes."""

import grpc
import pytest

from gaas.v1 import common_pb2, inference_pb2
from services.router.auth import Principal
from services.router.directory import MeshDirectory, ModelEntry
from services.router.stages import Stages
from services.router.scheduling import Candidate, WorkerId, make_scheduler
from gaas.model.tokenizer import ChatMessage
from tests.unit.router.support import AUTH, KEYS, OK, FakeTokenizer, FakeWorkers, chunk, collect, rpc_error, serve


async def test_streams_and_alternates_workers():
    rt, fake = await serve({"w0": OK, "w1": OK})
    try:
        first = await collect(rt, prompt="hi", request_id="req-1")
        await collect(rt, prompt="hi")
    finally:
        await rt.shutdown()
    assert [c.text for c in first] == ["a", "b"]
    assert first[-1].timings.router_ms > 0
    assert [a for a, _ in fake.calls] == ["w0", "w1"]
    forwarded = fake.calls[0][1]
    assert forwarded.request.model == "tiny"  # default model filled in
    # GaaS names the request with an id of its own; the client's travels along for the logs only.
    assert forwarded.request_id.startswith("req-") and forwarded.request_id != "req-1"
    assert forwarded.request.request_id == "req-1"
    assert fake.calls[1][1].request_id != forwarded.request_id
    # The router tokenized the prompt: the worker gets token ids and an explicit max_tokens.
    assert list(forwarded.request.prompt_token_ids) == FakeTokenizer().encode("hi") and not forwarded.request.prompt
    assert forwarded.request.max_tokens == 16
    assert forwarded.cache_salt == "salt-acme"
    assert first[-1].tenant == "acme" and fake.tenants == ["acme", "acme"]


@pytest.mark.parametrize(
    "metadata, message",
    [((), "missing API key"), ((("authorization", "Bearer nope"),), "unknown or was revoked")],
)
async def test_requests_need_a_known_key(metadata, message):
    rt, fake = await serve({"w0": OK, "w1": OK})
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(rt, metadata=metadata, prompt="hi")
    finally:
        await rt.shutdown()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in err.value.details()
    assert fake.calls == []


async def test_a_forged_tenant_header_is_not_believed():
    rt, fake = await serve({"w0": OK, "w1": OK})
    try:
        chunks = await collect(rt, metadata=AUTH + (("x-gaas-tenant", "victim"),), prompt="hi")
    finally:
        await rt.shutdown()
    assert chunks[-1].tenant == "acme" and fake.tenants == ["acme"]


async def test_retries_on_another_worker_before_the_first_token():
    rt, fake = await serve({"w0": [rpc_error(grpc.StatusCode.UNAVAILABLE)], "w1": OK})
    try:
        chunks = await collect(rt, prompt="hi")
    finally:
        await rt.shutdown()
    assert [c.text for c in chunks] == ["a", "b"]
    assert [a for a, _ in fake.calls] == ["w0", "w1"]


async def test_no_retry_once_a_token_was_sent():
    rt, fake = await serve({"w0": [chunk("a"), rpc_error(grpc.StatusCode.UNAVAILABLE, "engine died")], "w1": OK})
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(rt, prompt="hi")
    finally:
        await rt.shutdown()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed after it had streamed tokens" in err.value.details() and "may be retried" in err.value.details()
    assert "engine died" not in err.value.details(), "a worker's internal text never reaches the client"
    assert len(fake.calls) == 1


async def test_gives_up_after_the_retries():
    down = [rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")]
    rt, fake = await serve({"w0": down, "w1": down}, retries=1)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(rt, prompt="hi")
    finally:
        await rt.shutdown()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(fake.calls) == 2


@pytest.mark.parametrize(
    "req, code, message",
    [
        ({"prompt": "hi", "model": "huge"}, grpc.StatusCode.NOT_FOUND, "available: tiny"),
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "exactly one of prompt"),
        ({"prompt": "hi", "max_tokens": 100}, grpc.StatusCode.INVALID_ARGUMENT, "context of 64"),
    ],
)
async def test_bad_requests_never_reach_a_worker(req, code, message):
    rt, fake = await serve({"w0": OK, "w1": OK})
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(rt, **req)
    finally:
        await rt.shutdown()
    assert err.value.code() == code and message in err.value.details()
    assert fake.calls == []


async def test_no_workers_is_unavailable():
    rt, _ = await serve({}, workers=())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(rt, prompt="hi")
    finally:
        await rt.shutdown()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE \
        and "'tiny' is deployed with no workers" in err.value.details()


def test_a_public_prefix_replaces_the_tenants_salt_only_for_prompts_that_begin_with_it():
    from services.router.prepare import cache_salt, public_prefix

    model = ModelEntry("tiny", "1.0", 64, True, public_prefixes=(("pub_1", "You are helpful."),))

    def chat(*messages):
        return inference_pb2.GenerateRequest(messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in messages])

    def salt(request):
        return cache_salt(public_prefix(model, request), "tenant")

    assert salt(chat(("system", "You are helpful."), ("user", "hi"))) == "public:pub_1"
    assert salt(chat(("system", "You are helpful!"), ("user", "hi"))) == "tenant"
    assert salt(chat(("user", "You are helpful."))) == "tenant"
    assert salt(inference_pb2.GenerateRequest(prompt="You are helpful. Go.")) == "public:pub_1"
    assert salt(inference_pb2.GenerateRequest(prompt="Go.")) == "tenant"


async def test_the_engine_gets_the_tiers_band_whatever_priority_the_client_asks_for():
    from gaas.contracts import qos

    KEYS["key-cheap"] = Principal("cheap", "bronze", "key_2", "salt-cheap")
    rt, fake = await serve({"w0": OK, "w1": OK})
    try:
        await collect(rt, metadata=(("authorization", "Bearer key-cheap"),), prompt="hi", priority=common_pb2.PRIORITY_HIGH)
        await collect(rt, prompt="hi", priority=common_pb2.PRIORITY_LOW)
    finally:
        await rt.shutdown()
        del KEYS["key-cheap"]
    bronze_high, gold_low = (req.engine_priority for _, req in fake.calls)
    assert bronze_high == qos.engine_priority("bronze", common_pb2.PRIORITY_HIGH)
    assert gold_low == qos.engine_priority("gold", common_pb2.PRIORITY_LOW)
    assert gold_low < bronze_high  # vLLM serves lower values first


async def test_merged_streams_wait_for_a_slow_consumer_instead_of_piling_up():
    """A batch of prompts is several workers' streams merged for one client: while the client is
    behind, the streams are read no further than a small bound ahead of it."""
    import asyncio

    from gaas.v1 import common_pb2
    from gaas.runtime.streams import merge

    produced = [0, 0, 0]

    async def stream(i):
        for n in range(200):
            produced[i] += 1
            yield common_pb2.GenerateChunk(text=f"{i}-{n}")

    merged = merge([stream(i) for i in range(3)])
    first = [await merged.__anext__() for _ in range(5)]
    await asyncio.sleep(0.05)  # the consumer dawdles
    assert sum(produced) <= 5 + 2 * 3 + 3, f"read {produced} ahead of a consumer that took 5"
    rest = [x async for x in merged]
    assert len(first) + len(rest) == 600 and produced == [200, 200, 200]


async def test_under_a_public_prefix_the_worker_is_told_the_most_cached_tokens_usage_may_say():
    """The public prefix's blocks are shared by every tenant; past them a cache hit would tell a
    tenant that another sent the same continuation (a block-by-block oracle): the worker caps the
    cached tokens it reports at the prefix's own."""
    models = [ModelEntry("tiny", "1.0", 256, True, public_prefixes=(("pub_1", "You are helpful."),))]
    cands = [Candidate(WorkerId("w0"), "w0", "tiny", "1.0", 256)]

    async def fetch():
        return models, cands

    fake = FakeWorkers({"w0": OK})
    d = Stages(MeshDirectory(fetch, 1.0), make_scheduler("round_robin"), fake, lambda model: FakeTokenizer(),
                   retries=0, max_stream_seconds=30)
    acme = KEYS["key-acme"]
    shared = await d.preparer.prepare(inference_pb2.GenerateRequest(prompt="You are helpful. Tell me a secret."), acme)
    assert shared.cache_salt == "public:pub_1"
    assert shared.cached_cap == len(FakeTokenizer().encode("You are helpful."))
    own = await d.preparer.prepare(inference_pb2.GenerateRequest(prompt="Tell me a secret."), acme)
    assert own.cache_salt == acme.cache_salt and own.cached_cap is None
    chat = await d.preparer.prepare(inference_pb2.GenerateRequest(messages=[
        inference_pb2.ChatMessage(role="system", content="You are helpful."),
        inference_pb2.ChatMessage(role="user", content="A secret.")]), acme)
    assert chat.cached_cap == len(FakeTokenizer().encode_chat([ChatMessage("system", "You are helpful.")], False))
    assert d.placer.worker_request(shared, acme, "r1").cached_tokens_cap == shared.cached_cap
    assert not d.placer.worker_request(own, acme, "r2").HasField("cached_tokens_cap")
