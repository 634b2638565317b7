"""The router's servicer over a real gRPC server, with the control plane and the workers faked
behind their interfaces: authentication, picking, retrying before the first token, never after,
error codes."""

import grpc
import pytest

from gaas.runtime.server import ServerOptions, ServiceRuntime
from gaas.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.router.auth import Authenticator, Principal
from services.router.directory import MeshDirectory, ModelEntry
from services.router.dispatch import Dispatcher
from services.router.scheduling import Candidate, WorkerId, make_scheduler
from services.router.pipeline import Pipeline
from services.router.servicer import InferenceServicer
from gaas.model.tokenizer import ChatMessage

KEYS = {"key-acme": Principal("acme", "gold", "key_1", "salt-acme")}
AUTH = (("authorization", "Bearer key-acme"),)


def rpc_error(code, details="boom"):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeCall:
    """A grpc.aio stream call's read(): the script's chunks, then EOF (or its error)."""

    def __init__(self, script, request):
        self._steps = iter(script)
        self._request = request
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    async def read(self):
        step = next(self._steps, grpc.aio.EOF)
        if callable(step) and not isinstance(step, grpc.aio.AioRpcError):
            step = await step()  # (a step that takes its time)
        if isinstance(step, grpc.aio.AioRpcError):
            raise step
        return step


class FakeWorkers:
    """WorkerStub stand-in: each address follows its script (chunks, then maybe an error)."""

    def __init__(self, scripts):
        self.scripts = scripts
        self.calls = []  # (address, request)
        self.tenants = []
        self.made: list[FakeCall] = []

    def Generate(self, request, timeout=None, metadata=()):
        from gaas.runtime.context import current_tenant

        address = dict(metadata)["x-gaas-worker"]
        self.calls.append((address, request))
        self.tenants.append(current_tenant())  # what the channel's interceptor would send on
        call = FakeCall(self.scripts[address], request)
        self.made.append(call)
        return call


def chunk(text, final=False):
    c = common_pb2.GenerateChunk(text=text, token_ids=[1])
    if final:
        c.finish_reason = common_pb2.FINISH_REASON_LENGTH
        c.usage.completion_tokens = 2
    return c


OK = [chunk("a"), chunk("b", final=True)]


class FakeTokenizer:
    """One token per character (the real tokenizer is tested in tests/unit/model/test_tokenizer.py)."""

    vocab_size = 1000

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [1 + ord(c) % 900 for c in text]

    def render_chat(self, messages, add_generation_prompt=True, continue_final_message=False, tools=None):
        return "".join(f"<{m.role}>{m.content}" for m in messages)

    def encode_chat(self, messages, add_generation_prompt=True, continue_final_message=False, add_special_tokens=False, tools=None):
        return self.encode(self.render_chat(messages), add_special_tokens)

    def encode_continuing(self, text, prefix):
        return self.encode(text, False)

    def continued_chars(self, text, prefix):
        return len(text)


async def serve(scripts, workers=("w0", "w1"), retries=2, meter=None, moves=0):
    models = [ModelEntry("tiny", "1.0", 64, True)]
    cands = [Candidate(WorkerId(w), w, "tiny", "1.0", 64) for w in workers]

    async def fetch():
        return models, cands

    async def lookup(key):
        return KEYS.get(key)

    fake = FakeWorkers(scripts)
    dispatcher = Dispatcher(
        MeshDirectory(fetch, 1.0), make_scheduler("round_robin"), fake, lambda model: FakeTokenizer(),
        retries=retries, moves=moves, max_stream_seconds=30,
    )
    servicer = InferenceServicer(Pipeline(dispatcher, Authenticator(lookup, 2.0), meter))
    rt = ServiceRuntime(ServerOptions(service="t", instance="t", port=0, drain_seconds=0, grace_seconds=1, edge=True))
    rt.add_service(inference_pb2_grpc.add_InferenceServicer_to_server, servicer, "gaas.v1.Inference")
    await rt.start()
    return rt, fake


async def collect(rt, metadata=AUTH, **req):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        return [c async for c in stub.Generate(inference_pb2.GenerateRequest(**req), timeout=5, metadata=metadata)]


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
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no worker is serving 'tiny'" in err.value.details()


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
    import time

    models = [ModelEntry("tiny", "1.0", 4096, True)]
    cands = [Candidate(WorkerId(w), w, "tiny", "1.0", 4096, block_size=64) for w in workers]

    async def fetch():
        return models, cands

    dispatcher = Dispatcher(MeshDirectory(fetch, 1.0), make_scheduler("kv_aware"), FakeWorkers({w: OK for w in workers}),
                            lambda model: FakeTokenizer(), retries=0, max_stream_seconds=30, kv=kv)
    principal = KEYS["key-acme"]
    prepared = await dispatcher.prepare(
        inference_pb2.GenerateRequest(prompt_token_ids=list(range(1, 200)), max_tokens=4), principal)
    return dispatcher, principal, prepared, time.perf_counter()


async def test_the_kv_lookup_is_made_in_process_as_the_prompt_is_prepared_and_routes_where_the_prefix_is():
    import time

    kv = HeldKV()
    dispatcher, principal, prepared, prepared_at = await _prepared(("w0", "w1"), kv)
    assert len(prepared.block_hashes) == 3 and prepared.prefix.matched == {"w1": 3} and len(kv.asked) == 1
    chunks = [c async for c in dispatcher.stream(prepared, principal, "req-x", None, time.perf_counter())]
    assert [c.text for c in chunks] == ["a", "b"]
    assert [a for a, _ in dispatcher._workers.calls] == ["w1"]  # routed where the prefix is
    assert kv.provisioned == [("w1", 3, 3)]


async def test_with_one_worker_the_kv_directory_is_not_asked():
    import time

    kv = HeldKV()
    dispatcher, principal, prepared, _ = await _prepared(("w0",), kv)
    assert prepared.prefix is None and kv.asked == []
    chunks = [c async for c in dispatcher.stream(prepared, principal, "req-y", None, time.perf_counter())]
    assert [c.text for c in chunks] == ["a", "b"]
    assert kv.provisioned == []  # nothing to predict for: the engine's events tell the directory


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
    d = Dispatcher(MeshDirectory(fetch, 1.0), make_scheduler("round_robin"), fake, lambda model: FakeTokenizer(),
                   retries=0, max_stream_seconds=30)
    acme = KEYS["key-acme"]
    shared = await d.prepare(inference_pb2.GenerateRequest(prompt="You are helpful. Tell me a secret."), acme)
    assert shared.cache_salt == "public:pub_1"
    assert shared.cached_cap == len(FakeTokenizer().encode("You are helpful."))
    own = await d.prepare(inference_pb2.GenerateRequest(prompt="Tell me a secret."), acme)
    assert own.cache_salt == acme.cache_salt and own.cached_cap is None
    chat = await d.prepare(inference_pb2.GenerateRequest(messages=[
        inference_pb2.ChatMessage(role="system", content="You are helpful."),
        inference_pb2.ChatMessage(role="user", content="A secret.")]), acme)
    assert chat.cached_cap == len(FakeTokenizer().encode_chat([ChatMessage("system", "You are helpful.")], False))
    assert d.placer.worker_request(shared, acme, "r1").cached_tokens_cap == shared.cached_cap
    assert not d.placer.worker_request(own, acme, "r2").HasField("cached_tokens_cap")
