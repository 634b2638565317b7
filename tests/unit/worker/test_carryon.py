"""A direct stream that outlives its worker's engine (services/worker/carryon.py), with a fake engine
and fake peers: when the engine stops after tokens went out (it died, or the worker hands its
streams over), the front end carries the stream on at the next worker the router listed, from the
token ids sent, and the client sees one stream and one usage."""

import asyncio

import grpc
import pytest

from gaas.contracts import errors
from gaas.v1 import common_pb2
from services.worker.carryon import CarryOn, CarryOnMetrics
from services.worker.engine import Delta, EngineUnavailable
from services.worker.servicer import WorkerServicer
from tests.unit.contracts.support import tok
from tests.unit.router.support import rpc_error
from tests.unit.worker.support import FakeEngine, wreq


def dies_after(k, tokens=6):
    """An engine's deltas for tokens 1..k, then its death."""
    class Dying(FakeEngine):
        async def generate(self, r):
            self.requests.append(r)
            for i in range(1, k + 1):
                yield Delta(text=f"t{i}", token_ids=[i], completion_tokens=i, first=i == 1,
                            prompt_tokens=3 if i == 1 else 0, cached_tokens=1 if i == 1 else 0)
            raise EngineUnavailable("this worker's engine stopped; another worker may take the request")
    return Dying()


class FakePeers:
    """A WorkerStub through the sidecar: per address, the chunks its stream gives (an exception
    in the script: the call fails there)."""

    def __init__(self, scripts):
        self.scripts = scripts
        self.calls = []

    def Generate(self, request, timeout=None, metadata=()):
        address = dict(metadata)["x-gaas-worker"]
        self.calls.append((address, request))
        script = self.scripts[address]

        class Call:
            def cancel(self):
                pass

            def __aiter__(self):
                return self._run()

            async def _run(self):
                for item in script:
                    if isinstance(item, Exception):
                        raise item
                    await asyncio.sleep(0)
                    yield item

        return Call()


def request():
    r = wreq(max_tokens=6, sampling=common_pb2.SamplingParams(temperature=0, seed=5))
    r.request.prompt_token_ids[:] = [101, 102, 103]
    return r


async def collect(stream):
    return [c async for c in stream]


async def test_an_engine_that_dies_mid_stream_is_carried_on_at_the_next_worker_and_the_client_sees_one_stream():
    moved = CarryOnMetrics()
    peers = FakePeers({"w1:1": [tok(3, "t3", prefill=(5, 0)), tok(4, "t4"), tok(5, "t5"), tok(6, "t6", final=(5, 0, 4))]})
    carry = CarryOn(WorkerServicer("worker-0", dies_after(2)), peers, "w0:1", moved)
    chunks = await collect(carry.stream(request(), ["w1:1", "w2:1"], None))
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5, 6]
    assert [c.HasField("prefill") for c in chunks] == [True, False, False, False, False, False]
    usage = chunks[-1].usage
    # The client's prompt, as cached as the first engine found it, and every token it received.
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (3, 1, 6)
    [(address, cont)] = peers.calls
    assert address == "w1:1"
    assert list(cont.request.prompt_token_ids) == [101, 102, 103, 1, 2]
    assert cont.request.max_tokens == 4 and cont.request.sampling.seed == 5 and cont.request_id == "req-1"


async def test_a_worker_handing_its_streams_over_carries_them_on_too():
    engine = FakeEngine(tokens=6, delay=0.01)
    servicer = WorkerServicer("worker-0", engine)
    peers = FakePeers({"w1:1": [tok(4, "t4", prefill=(6, 0)), tok(5, "t5"), tok(6, "t6", final=(6, 0, 3))]})
    carry = CarryOn(servicer, peers, "w0:1")
    got = []
    async for c in carry.stream(request(), ["w1:1"], None):
        got.append(c)
        if len(got) == 3:
            servicer.handing_over = True  # the worker is stopping
    assert [t for c in got for t in c.token_ids] == [1, 2, 3, 4, 5, 6]
    assert list(peers.calls[0][1].request.prompt_token_ids) == [101, 102, 103, 1, 2, 3]


async def test_a_worker_that_fails_the_continuation_hands_it_to_the_next_and_its_own_address_is_skipped():
    peers = FakePeers({
        "w1:1": [tok(3, "t3", prefill=(5, 0)), rpc_error(grpc.StatusCode.UNAVAILABLE, "reset")],
        "w2:1": [tok(4, "t4", prefill=(6, 0)), tok(5, "t5"), tok(6, "t6", final=(6, 0, 3))],
    })
    carry = CarryOn(WorkerServicer("worker-0", dies_after(2)), peers, "w0:1")
    chunks = await collect(carry.stream(request(), ["w0:1", "w1:1", "w2:1"], None))
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5, 6]
    assert [a for a, _ in peers.calls] == ["w1:1", "w2:1"]
    assert list(peers.calls[1][1].request.prompt_token_ids) == [101, 102, 103, 1, 2, 3]
    assert chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("carry_on, scripts", [
    ([], {}),  # no other worker serves the model
    (["w1:1"], {"w1:1": [rpc_error(grpc.StatusCode.UNAVAILABLE, "down")]}),  # the one there is fails too
    (["w1:1"], {"w1:1": [rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad")]}),  # its own answer: not tried on
], ids=["no other worker", "the other fails", "the other refuses"])
async def test_a_stream_no_other_worker_carries_on_ends_with_a_message_and_no_internal_text(carry_on, scripts):
    carry = CarryOn(WorkerServicer("worker-0", dies_after(2)), FakePeers(scripts), "w0:1")
    got = []
    with pytest.raises(errors.Unavailable) as err:
        async for c in carry.stream(request(), carry_on, None):
            got.append(c)
    assert len(got) == 2
    assert "no other worker could carry it on" in err.value.message and "req-1" in err.value.message
    assert "down" not in err.value.message and "bad" not in err.value.message


async def test_an_engine_that_stops_before_the_first_token_is_the_ingress_business():
    """Nothing went out: the failure is raised (the ingress sends the request to the router's
    second choice), not carried on."""
    peers = FakePeers({"w1:1": [tok(1, "t1", final=(3, 0, 1))]})
    carry = CarryOn(WorkerServicer("worker-0", dies_after(0)), peers, "w0:1")
    with pytest.raises(errors.Unavailable):
        await collect(carry.stream(request(), ["w1:1"], None))
    assert peers.calls == []


async def test_a_stream_whose_last_token_went_out_just_ends():
    carry = CarryOn(WorkerServicer("worker-0", dies_after(6)), FakePeers({}), "w0:1")
    chunks = await collect(carry.stream(request(), ["w1:1"], None))
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].worker_id == "worker-0"
