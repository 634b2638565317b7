"""Through the router (services/router/relay.py): a worker that fails mid-stream is replaced by another
that carries the stream on (gaas/contracts/continuation.py), and the client sees one stream."""

import grpc
import pytest

from gaas.v1 import common_pb2
from tests.unit.contracts.support import tok
from tests.unit.router.support import FakeTokenizer, collect, rpc_error, serve


def worker_dies_after(*tokens):
    return [*tokens, rpc_error(grpc.StatusCode.UNAVAILABLE, "upstream connect error or disconnect/reset")]


async def test_a_worker_dying_mid_stream_is_replaced_and_the_client_sees_one_stream():
    prompt = FakeTokenizer().encode("hi")
    w0 = worker_dies_after(tok(40, "a", prefill=(len(prompt), 1)), tok(41, "b"))
    w1 = [tok(42, "c", prefill=(len(prompt) + 2, 0)), tok(43, "d", final=(len(prompt) + 2, 0, 2))]
    rt, fake = await serve({"w0": w0, "w1": w1}, moves=2)
    try:
        chunks = await collect(rt, prompt="hi", max_tokens=4, sampling=common_pb2.SamplingParams(temperature=0, seed=3))
    finally:
        await rt.shutdown()
    assert "".join(c.text for c in chunks) == "abcd"
    assert [t for c in chunks for t in c.token_ids] == [40, 41, 42, 43]
    assert [c.HasField("prefill") for c in chunks] == [True, False, False, False]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (len(prompt), 1, 4)
    assert [a for a, _ in fake.calls] == ["w0", "w1"]
    cont = fake.calls[1][1]
    assert list(cont.request.prompt_token_ids) == prompt + [40, 41]
    assert cont.request.max_tokens == 2 and cont.request.sampling.seed == 3
    assert cont.request_id == fake.calls[0][1].request_id


async def test_a_stream_is_not_moved_more_than_the_router_allows():
    w0 = worker_dies_after(tok(40, "a", prefill=(3, 0)))
    w1 = worker_dies_after(tok(41, "b", prefill=(4, 0)))
    rt, fake = await serve({"w0": w0, "w1": w1, "w2": w1}, workers=("w0", "w1", "w2"), moves=1)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(rt, prompt="hi", max_tokens=4)
    finally:
        await rt.shutdown()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed after it had streamed tokens" in err.value.details()
    assert "reset" not in err.value.details(), "a worker's internal text never reaches the client"
    assert len(fake.calls) == 2, "one move, then the second failure reaches the client"


async def test_with_no_other_worker_the_client_is_told_the_stream_cannot_go_on():
    rt, fake = await serve({"w0": worker_dies_after(tok(40, "a", prefill=(3, 0)))}, workers=("w0",), moves=2)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(rt, prompt="hi", max_tokens=4)
    finally:
        await rt.shutdown()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no other worker could carry it on" in err.value.details()
    assert len(fake.calls) == 1


@pytest.mark.parametrize("w0, extra", [
    # A worker's own answer mid-stream is not a failure another worker could carry on from.
    ([tok(40, "a", prefill=(3, 0)), rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad")], {}),
    # Several choices run together on one worker: not carried on.
    (worker_dies_after(tok(40, "a", prefill=(3, 0))), {"n": 2}),
], ids=["a worker refusing mid-stream", "several choices"])
async def test_a_stream_that_cannot_be_carried_on_fails_on_its_first_worker(w0, extra):
    rt, fake = await serve({"w0": w0, "w1": [tok(41, "b", final=(3, 0, 1))]}, moves=2)
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(rt, prompt="hi", max_tokens=4, **extra)
    finally:
        await rt.shutdown()
    assert len(fake.calls) == 1
