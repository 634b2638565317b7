"""The worker's servicer over a real gRPC server with a fake engine: chunk mapping, usage on the
last chunk, cancellation reaching the engine, and error codes."""

import asyncio
import dataclasses

import grpc
import numpy as np
import pytest

from gaas.runtime.server import ServerOptions, ServiceRuntime
from gaas.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from gaas.contracts.finish import LENGTH
from services.worker.engine import (
    Delta,
    EngineBusy,
    EngineFailed,
    EngineUnavailable,
    InvalidRequest,
    TokenLogprob,
)
from services.worker.servicer import WorkerServicer
from tests.unit.worker.support import INFO, FakeEngine, wreq
from tests.waiting import eventually_async


async def serve(engine, max_waiting=0):
    rt = ServiceRuntime(ServerOptions(service="t", instance="t", port=0, drain_seconds=0, grace_seconds=1))
    rt.add_service(worker_pb2_grpc.add_WorkerServicer_to_server, WorkerServicer("worker-7", engine, max_waiting=max_waiting),
                   "gaas.v1.Worker")
    await rt.start()
    return rt


async def test_streams_deltas_with_usage_last():
    engine = FakeEngine()
    rt = await serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            chunks = [c async for c in worker_pb2_grpc.WorkerStub(ch).Generate(
                wreq(prompt="hi", max_tokens=3, cache_salt="s", sampling=common_pb2.SamplingParams(temperature=0)),
                timeout=5)]
    finally:
        await rt.shutdown()
    assert [c.text for c in chunks] == ["t1", "t2", "t3"]
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.cached_tokens, last.usage.completion_tokens) == (5, 2, 3)
    assert (last.worker_id, last.model, last.model_version) == ("worker-7", "tiny", "1.0")
    assert last.timings.engine_ms >= last.timings.ttft_ms > 0
    assert not chunks[0].HasField("usage")
    r = engine.requests[0]
    assert (r.request_id, r.cache_salt, r.max_tokens, r.sampling) == ("req-1", "s", 3, {"temperature": 0.0})
    assert (r.n, r.logprobs, r.add_special_tokens) == (1, None, True)


async def generate(engine, request):
    rt = await serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            return [c async for c in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=5)]
    finally:
        await rt.shutdown()


async def test_an_embeddings_request_is_one_engine_batch_answered_in_one_chunk_with_a_vector_per_input():
    engine = FakeEngine()
    engine.info = dataclasses.replace(INFO, task="embed")
    request = wreq(cache_salt="s")
    request.request.embed.inputs.add(token_ids=[4, 5, 6])
    request.request.embed.inputs.add(token_ids=[7])
    (chunk,) = await generate(engine, request)
    assert [np.frombuffer(v, "<f4").tolist() for v in chunk.embeddings] == [[0.0, 3.0], [1.0, 1.0]]
    assert (chunk.usage.prompt_tokens, chunk.usage.cached_tokens, chunk.usage.completion_tokens) == (4, 1, 0)
    assert chunk.finish_reason == common_pb2.FINISH_REASON_STOP and chunk.worker_id == "worker-7"
    assert chunk.timings.engine_ms == chunk.timings.ttft_ms > 0
    (r,) = engine.requests
    assert (r.inputs, r.cache_salt, r.dimensions) == ([[4, 5, 6], [7]], "s", None)


async def test_an_embeddings_request_to_a_worker_handing_over_or_full_is_refused_untaken():
    engine = FakeEngine()
    engine.info = dataclasses.replace(INFO, task="embed")
    servicer = WorkerServicer("worker-7", engine, max_waiting=1)
    request = wreq()
    request.request.embed.inputs.add(token_ids=[4])
    servicer.handing_over = True
    with pytest.raises(EngineUnavailable, match="stopping"):
        [c async for c in servicer.Generate(request, None)]
    servicer.handing_over, servicer._waiting = False, 1  # (one request waits on the engine)
    with pytest.raises(EngineBusy, match="queue is full"):
        [c async for c in servicer.Generate(request, None)]
    assert engine.requests == []


async def test_an_embeddings_request_decided_at_the_ingress_is_answered_by_the_worker_in_vllms_shape():
    import json

    from google.api import httpbody_pb2

    from gaas.metering import direct
    from services.worker.direct import DirectServicer

    engine = FakeEngine()
    engine.info = dataclasses.replace(INFO, task="embed")
    d = worker_pb2.DirectGenerate(request_id="req-9", openai_body=b'{"model": "tiny", "input": [[4, 5, 6], [7]]}')
    d.metering.tenant, d.metering.model = "acme", "tiny"
    d.prompts.append(wreq())
    d.prompts[0].request.embed.inputs.add(token_ids=[4, 5, 6])
    d.prompts[0].request.embed.inputs.add(token_ids=[7])
    front = DirectServicer(WorkerServicer("worker-7", engine), None)
    pieces = [b.data async for b in front.embeddings(httpbody_pb2.HttpBody(content_type=direct.CONTENT_TYPE,
                                                                           data=d.SerializeToString()))]
    answer = json.loads(b"".join(pieces))
    assert (answer["id"], answer["model"], answer["usage"]["prompt_tokens"]) == ("embd-9", "tiny", 4)
    assert [x["embedding"] for x in answer["data"]] == [[0.0, 3.0], [1.0, 1.0]]


async def test_a_worker_asked_for_what_its_model_does_not_serve_says_what_it_serves():
    embeds = FakeEngine()
    embeds.info = dataclasses.replace(INFO, task="embed")
    with pytest.raises(grpc.aio.AioRpcError, match="serves embeddings"):
        await generate(embeds, wreq(prompt="hi", max_tokens=3))
    request = wreq()
    request.request.embed.inputs.add(text="hi")
    with pytest.raises(grpc.aio.AioRpcError, match="serves completions and chats"):
        await generate(FakeEngine(), request)


async def test_choices_and_logprobs_map_to_chunks():
    """n > 1: each choice's chunks carry its index and its own finish; usage only on the request's last."""
    lp = TokenLogprob(7, "x", -0.5, [(7, "x", -0.5, 2), (9, "y", -0.25, 1)])
    script = [
        Delta("a", [7], index=1, completion_tokens=1, logprobs=[lp]),
        Delta("b", [7], index=0, completion_tokens=2, finish_reason=LENGTH, logprobs=[lp]),
        Delta("c", [7], index=1, completion_tokens=3, finish_reason=LENGTH, done=True, prompt_tokens=4, logprobs=[lp]),
    ]
    engine = FakeEngine(script=script)
    rt = await serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            chunks = [c async for c in worker_pb2_grpc.WorkerStub(ch).Generate(
                wreq(prompt="hi", max_tokens=3, n=2, logprobs=1), timeout=5)]
    finally:
        await rt.shutdown()
    assert [(c.index, c.text) for c in chunks] == [(1, "a"), (0, "b"), (1, "c")]
    assert chunks[1].finish_reason == common_pb2.FINISH_REASON_LENGTH and not chunks[1].HasField("usage")
    assert chunks[2].usage.completion_tokens == 3 and chunks[2].worker_id == "worker-7"
    top = chunks[0].logprobs[0].top
    assert [(t.token_id, t.token, t.logprob, t.rank) for t in top] == [(7, "x", -0.5, 2), (9, "y", -0.25, 1)]
    assert (engine.requests[0].n, engine.requests[0].logprobs) == (2, 1)


async def test_cancel_aborts_the_engine_request():
    engine = FakeEngine(tokens=1000, delay=0.01)
    rt = await serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            call = worker_pb2_grpc.WorkerStub(ch).Generate(wreq(prompt="hi", max_tokens=200), timeout=10)
            async for _ in call:
                break
            call.cancel()
            await asyncio.wait_for(engine.aborted.wait(), timeout=5)
    finally:
        await rt.shutdown()


@pytest.mark.parametrize(
    "engine, req, code, message",
    [
        (FakeEngine(), wreq(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "exactly one of prompt"),
        (FakeEngine(), wreq(prompt="hi", max_tokens=300), grpc.StatusCode.INVALID_ARGUMENT, "context of 256"),
        (FakeEngine(), wreq(request_id="", prompt="hi"), grpc.StatusCode.INVALID_ARGUMENT, "request_id is required"),
        (FakeEngine(), wreq(prompt="hi", model="big"), grpc.StatusCode.FAILED_PRECONDITION, "serves 'tiny'"),
        (FakeEngine(fail=InvalidRequest("prompt too long")), wreq(prompt="hi"), grpc.StatusCode.INVALID_ARGUMENT, "too long"),
        (FakeEngine(fail=EngineUnavailable("engine died")), wreq(prompt="hi"), grpc.StatusCode.UNAVAILABLE, "died"),
        (None, wreq(prompt="hi"), grpc.StatusCode.UNAVAILABLE, "still loading"),
    ],
)
async def test_errors(engine, req, code, message):
    rt = await serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [c async for c in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=5)]
    finally:
        await rt.shutdown()
    assert err.value.code() == code and message in err.value.details()


async def test_get_load():
    rt = await serve(FakeEngine())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    finally:
        await rt.shutdown()
    assert (load.worker_id, load.kv_cache_usage) == ("worker-7", 0.25)


@pytest.mark.parametrize(
    "error, code",
    [
        (EngineBusy("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (EngineFailed("internal error (request id req-1): see the logs"), grpc.StatusCode.INTERNAL),
        (RuntimeError("secret internal detail"), grpc.StatusCode.INTERNAL),
    ],
)
async def test_engine_faults(error, code):
    rt = await serve(FakeEngine(fail=error))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [c async for c in worker_pb2_grpc.WorkerStub(ch).Generate(wreq(prompt="hi"), timeout=5)]
    finally:
        await rt.shutdown()
    assert err.value.code() == code
    assert "secret internal detail" not in err.value.details(), "internal exception text never reaches a caller"
    if code == grpc.StatusCode.INTERNAL:
        assert "internal error (request id req-" in err.value.details()


async def test_a_full_waiting_queue_refuses_with_resource_exhausted_and_the_tier_priority_reaches_the_engine():
    engine = FakeEngine(tokens=2, delay=0.3)
    rt = await serve(engine, max_waiting=2)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            calls = [stub.Generate(wreq(f"r{i}", prompt_token_ids=[1, 2]), timeout=5) for i in range(2)]
            firsts = [asyncio.create_task(c.read()) for c in calls]
            await eventually_async(lambda: len(engine.requests) >= 2, 5, every=0.01,
                                   what="both requests waiting for their first token")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [c async for c in stub.Generate(wreq("r3", prompt_token_ids=[1]), timeout=5)]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.value.details()
            await asyncio.gather(*firsts)
            prioritized = wreq("r4", prompt_token_ids=[1], priority=common_pb2.PRIORITY_HIGH)
            prioritized.engine_priority = 7
            prioritized.stream_interval = 1000  # the router's coalescing, capped
            [c async for c in stub.Generate(prioritized, timeout=5)]  # room again once they streamed
            for c in calls:
                c.cancel()
    finally:
        await rt.shutdown()
    assert engine.requests[-1].priority == 7, "the router's tier-bound priority, not the client's"
    assert engine.requests[-1].stream_interval == 64 and engine.requests[0].stream_interval == 0


async def test_the_cached_tokens_reported_stay_within_the_cap_the_router_gave():
    """Under a public prefix the router sends cached_tokens_cap: the usage (and the first chunk's
    prefill) never say more were cached, whatever the engine served from its cache."""
    engine = FakeEngine(script=[
        Delta(text="a", token_ids=[1], completion_tokens=1, first=True, prompt_tokens=200, cached_tokens=192),
        Delta(text="b", token_ids=[2], completion_tokens=2, finish_reason=LENGTH, done=True, prompt_tokens=200,
              cached_tokens=192),
    ])
    rt = await serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            req = wreq(prompt_token_ids=[1] * 200, max_tokens=2)
            req.cached_tokens_cap = 40
            chunks = [c async for c in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=5)]
            plain = [c async for c in worker_pb2_grpc.WorkerStub(ch).Generate(wreq(prompt_token_ids=[1] * 200,
                                                                                   max_tokens=2), timeout=5)]
    finally:
        await rt.shutdown()
    assert chunks[0].prefill.cached_tokens == 40 and chunks[-1].usage.cached_tokens == 40
    assert chunks[0].prefill.prompt_tokens == 200
    assert plain[-1].usage.cached_tokens == 192, "without a cap, what the engine served"


async def test_a_stopping_worker_hands_its_streams_over_at_the_next_token():
    engine = FakeEngine(tokens=1000, delay=0.01)
    servicer = WorkerServicer("worker-7", engine)
    rt = ServiceRuntime(ServerOptions(service="t", instance="t", port=0, drain_seconds=0, grace_seconds=1))
    rt.add_service(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "gaas.v1.Worker")
    await rt.start()
    got = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            call = worker_pb2_grpc.WorkerStub(ch).Generate(wreq(prompt="hi", max_tokens=200), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for c in call:
                    got.append(c)
                    if len(got) == 3:
                        servicer.handing_over = True
            await asyncio.wait_for(engine.aborted.wait(), timeout=5)
    finally:
        await rt.shutdown()
    # UNAVAILABLE after the tokens sent: what a router carries on at another worker.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "another worker carries the stream on" in err.value.details()
    assert 3 <= len(got) < 10
