"""Stage 6, stream (services/router/relay.py), with the workers, directory and tokenizer faked: a
worker that does not take the request is replaced while no token has gone out, never after; one
the router's sidecar does not know yet is tried again; each
worker's failure is its breaker's; the room a request took is given back however it ends; the last
chunk carries the request's latency decomposition."""

import time

import grpc
import pytest

from gaas.contracts import errors
from gaas.contracts.principal import Principal
from gaas.v1 import inference_pb2
from services.router import relay as relay_module
from services.router.scheduling import WorkerId
from tests.unit.router import support
from tests.unit.router.support import OK, FakeWorkers, chunk, rpc_error

ACME = Principal("acme", "gold", "key_1", "salt-acme")


def relay(scripts, retries=2):
    fake = FakeWorkers({f"{w}:1": s for w, s in scripts.items()})
    return support.stages(tuple(scripts), workers_stub=fake, retries=retries, metrics=support.metrics()), fake


async def run(d, tenant_s=0.0, ingress_s=0.0):
    prepared = await d.preparer.prepare(inference_pb2.GenerateRequest(model="tiny", prompt="hi", max_tokens=4), ACME)
    return [c async for c in d.relay.stream(prepared, ACME, "req-1", None, time.perf_counter(), tenant_s, ingress_s)]


async def test_a_worker_that_does_not_take_the_request_is_replaced_and_its_breaker_told():
    d, fake = relay({"w0": [rpc_error(grpc.StatusCode.UNAVAILABLE)], "w1": OK})
    chunks = await run(d)
    assert [c.text for c in chunks] == ["a", "b"]
    assert [a for a, _ in fake.calls] == ["w0:1", "w1:1"]
    assert d.flow.breakers.state()[WorkerId("w0")].consecutive == 1
    assert d.in_flight == 0 and d.flow.windows.state()[WorkerId("w0")].in_flight == 0


async def test_a_worker_the_routers_sidecar_does_not_know_yet_is_tried_again_and_its_breaker_not_told(monkeypatch):
    monkeypatch.setattr(relay_module, "SIDECAR_LAG_PAUSE_S", 0.0)
    unknown = rpc_error(grpc.StatusCode.UNAVAILABLE, relay_module.SIDECAR_UNKNOWN)
    d, fake = relay({"w0": iter([[unknown], [unknown], OK])}, retries=0)
    chunks = await run(d)
    assert [c.text for c in chunks] == ["a", "b"]
    assert [a for a, _ in fake.calls] == ["w0:1"] * 3
    assert d.flow.breakers.state()[WorkerId("w0")].consecutive == 0
    assert d.in_flight == 0


async def test_once_a_token_went_out_a_failing_worker_is_not_retried():
    d, fake = relay({"w0": [chunk("a"), rpc_error(grpc.StatusCode.UNAVAILABLE, "engine died")], "w1": OK})
    seen = []
    with pytest.raises(errors.Unavailable, match="failed after it had streamed tokens") as err:
        prepared = await d.preparer.prepare(inference_pb2.GenerateRequest(model="tiny", prompt="hi", max_tokens=4),
                                            ACME)
        async for c in d.relay.stream(prepared, ACME, "req-1", None, time.perf_counter()):
            seen.append(c.text)
    assert seen == ["a"] and len(fake.calls) == 1
    assert "engine died" not in str(err.value)  # a worker's own text never reaches the client
    assert d.in_flight == 0


async def test_a_request_the_worker_refuses_as_invalid_is_not_tried_elsewhere():
    d, fake = relay({"w0": [rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad")], "w1": OK})
    with pytest.raises(errors.GaasError):
        await run(d)
    assert len(fake.calls) == 1 and d.in_flight == 0


async def test_it_gives_up_after_its_retries():
    down = [rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")]
    d, fake = relay({"w0": down, "w1": down}, retries=1)
    with pytest.raises(errors.Unavailable):
        await run(d)
    assert len(fake.calls) == 2 and d.in_flight == 0


async def test_the_last_chunk_carries_the_latency_decomposition_and_the_request_is_counted():
    d, _ = relay({"w0": OK})
    chunks = await run(d, tenant_s=0.002, ingress_s=0.001)
    t = chunks[-1].timings
    assert t.tenant_ms == pytest.approx(2.0) and t.ingress_ms == pytest.approx(1.0)
    assert t.total_ms >= t.tenant_ms + t.ingress_ms
    assert d.metrics.requests.labels("tiny", "gold", "length")._value.get() == 1
    assert d.metrics.tokens.labels("tiny", "gold", "completion")._value.get() == 2
