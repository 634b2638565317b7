"""The server interceptor around all four kinds of call (unary or streamed request, unary or
streamed answer), through a real grpc.aio server in this process: each gets its request context
from the metadata, is counted in the RPC metrics, and has its failures answered as statuses (or,
through status.answer_in_stream, inside its stream)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gaas.contracts import errors
from gaas.runtime import status
from gaas.runtime.context import client_request_id_var, current_request_id, current_tenant
from gaas.runtime.interceptors import ServerContextInterceptor
from gaas.runtime.metrics import ServiceMetrics
from gaas.v1 import common_pb2
from tests.waiting import eventually_async

SERVICE = "test.Arity"
Chunk = common_pb2.GenerateChunk
ARITIES = ("Unary", "ServerStream", "ClientStream", "Bidi")
METADATA = (("x-gaas-request-id", "req-abc"), ("x-gaas-tenant", "acme"), ("x-request-id", "client-1"))


def _act(text: str) -> Chunk:
    """What the handler does for a request text: fail as named, or echo what the context holds."""
    if text == "not-found":
        raise errors.NotFound("no such thing", param="model")
    if text == "bug":
        raise KeyError("secret-table-name")
    if text == "peer-down":
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "connection refused to 10.0.0.7:9000")
    if text == "peer-bug":
        raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "the peer's own words")
    return Chunk(text=f"{current_request_id()}|{current_tenant()}|{client_request_id_var.get()}|{text}")


async def _joined(request_iterator) -> str:
    return "".join([r.text async for r in request_iterator])


async def unary(request, context):
    return _act(request.text)


async def server_stream(request, context):
    yield Chunk(text="first")
    if request.text == "hang":
        await asyncio.Event().wait()
    yield _act(request.text)


async def client_stream(request_iterator, context):
    return _act(await _joined(request_iterator))


async def bidi(request_iterator, context):
    async for request in request_iterator:
        if request.text == "hang":
            yield Chunk(text="first")
            await asyncio.Event().wait()
        if request.text == "in-stream":
            try:
                raise errors.ResourceExhausted("slow down", retry_after=2.0)
            except Exception as exc:  # noqa: BLE001 - the hook under test
                err = status.answer_in_stream(exc)
                assert err is not None
                yield Chunk(text=f"refused:{err.code}:{err.message}")
            return
        yield _act(request.text)


HANDLERS = {
    "Unary": grpc.unary_unary_rpc_method_handler(unary, Chunk.FromString, Chunk.SerializeToString),
    "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, Chunk.FromString, Chunk.SerializeToString),
    "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream, Chunk.FromString, Chunk.SerializeToString),
    "Bidi": grpc.stream_stream_rpc_method_handler(bidi, Chunk.FromString, Chunk.SerializeToString),
}


@contextlib.asynccontextmanager
async def serving(edge: bool = False):
    metrics = ServiceMetrics("t", registry=CollectorRegistry())
    server = grpc.aio.server(interceptors=[ServerContextInterceptor(metrics, edge=edge)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, metrics
    finally:
        await server.stop(1)  # (a grace: a handler still counting its call after answering finishes)


async def call(channel, arity: str, text: str, *, serialize=Chunk.SerializeToString) -> list[str]:
    """The texts answered to a call of arity carrying text (in two messages when the request streams)."""
    path = f"/{SERVICE}/{arity}"
    kw = {"request_serializer": serialize, "response_deserializer": Chunk.FromString}
    halves = [Chunk(text=text[: len(text) // 2]), Chunk(text=text[len(text) // 2:])]
    if arity == "Unary":
        return [(await channel.unary_unary(path, **kw)(Chunk(text=text), metadata=METADATA, timeout=5)).text]
    if arity == "ServerStream":
        return [c.text async for c in channel.unary_stream(path, **kw)(Chunk(text=text), metadata=METADATA, timeout=5)]
    if arity == "ClientStream":
        return [(await channel.stream_unary(path, **kw)(iter(halves), metadata=METADATA, timeout=5)).text]
    # A bidirectional stream: the request whole, in one message, so that the handler acts on it.
    return [c.text async for c in channel.stream_stream(path, **kw)(iter([Chunk(text=text)]), metadata=METADATA,
                                                                      timeout=5)]


def counted(metrics: ServiceMetrics, method: str, code: str) -> float:
    return metrics.registry.get_sample_value("gaas_t_grpc_requests_total", {"method": method, "code": code}) or 0.0


@pytest.mark.parametrize("arity", ARITIES)
async def test_every_kind_of_call_gets_its_context_from_the_metadata_and_is_counted(arity):
    async with serving() as (channel, metrics):
        answered = await call(channel, arity, "hello")
    assert answered[-1] == "req-abc|acme|client-1|hello"
    assert counted(metrics, arity, "OK") == 1
    assert metrics.registry.get_sample_value("gaas_t_grpc_duration_seconds_count", {"method": arity}) == 1


@pytest.mark.parametrize("arity", ARITIES)
async def test_at_the_edge_every_kind_of_call_mints_its_own_request_id(arity):
    async with serving(edge=True) as (channel, _):
        answered = await call(channel, arity, "hello")
    rid, tenant, client, _ = answered[-1].split("|")
    assert rid.startswith("req-") and rid != "req-abc" and tenant == "" and client == "client-1"


async def _failed(channel, arity: str, text: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(channel, arity, text)
    return err.value


@pytest.mark.parametrize("arity", ARITIES)
async def test_a_domain_error_becomes_its_status_with_details_on_every_kind_of_call(arity):
    async with serving() as (channel, metrics):
        err = await _failed(channel, arity, "not-found")
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details() == "no such thing"
    back = status.from_rpc(err)
    assert isinstance(back, errors.NotFound) and back.param == "model"
    assert counted(metrics, arity, "NOT_FOUND") == 1


@pytest.mark.parametrize("arity", ARITIES)
async def test_an_unexpected_failure_is_internal_without_its_text_on_every_kind_of_call(arity):
    async with serving() as (channel, metrics):
        err = await _failed(channel, arity, "bug")
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in err.details() and "internal error (request id req-abc)" in err.details()
    assert counted(metrics, arity, "INTERNAL") == 1


@pytest.mark.parametrize("arity", ARITIES)
async def test_a_peers_failure_the_handler_left_is_mapped_on_every_kind_of_call(arity):
    async with serving() as (channel, metrics):
        down = await _failed(channel, arity, "peer-down")
        refused = await _failed(channel, arity, "peer-bug")
    assert down.code() == grpc.StatusCode.UNAVAILABLE
    assert down.details() == "a service this call needs did not answer; retry shortly"
    # The peer refused what this process sent it: this process's fault, and the peer's words stay here.
    assert refused.code() == grpc.StatusCode.INTERNAL and "own words" not in refused.details()
    assert counted(metrics, arity, "UNAVAILABLE") == 1 and counted(metrics, arity, "INTERNAL") == 1


@pytest.mark.parametrize("arity", ARITIES)
async def test_a_malformed_message_is_invalid_argument_on_every_kind_of_call(arity):
    async with serving() as (channel, metrics):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(channel, arity, "x", serialize=lambda _: b"\xff\xff\xff")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid GenerateChunk" in err.value.details()
    assert counted(metrics, arity, "INVALID_ARGUMENT") == 1


async def test_a_server_stream_that_fails_after_its_first_message_ends_with_the_mapped_status():
    async with serving() as (channel, _):
        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for c in channel.unary_stream(f"/{SERVICE}/ServerStream", request_serializer=Chunk.SerializeToString,
                                                response_deserializer=Chunk.FromString)(Chunk(text="not-found"),
                                                                                        timeout=5):
                seen.append(c.text)
    assert seen == ["first"] and err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_bidi_stream_that_fails_after_answering_ends_with_the_mapped_status():
    async with serving() as (channel, metrics):
        stream = channel.stream_stream(f"/{SERVICE}/Bidi", request_serializer=Chunk.SerializeToString,
                                       response_deserializer=Chunk.FromString)(metadata=METADATA, timeout=5)
        await stream.write(Chunk(text="hello"))
        first = await stream.read()
        await stream.write(Chunk(text="not-found"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.read()
    assert first.text == "req-abc|acme|client-1|hello"
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details() == "no such thing"
    assert counted(metrics, "Bidi", "NOT_FOUND") == 1


async def test_a_failure_answered_inside_the_stream_ends_the_call_ok_but_is_counted_under_its_code():
    async with serving() as (channel, metrics):
        answered = await call(channel, "Bidi", "in-stream")
        await call(channel, "Bidi", "hello")  # the next call on the same server starts clean
    assert answered == ["refused:RESOURCE_EXHAUSTED:slow down"]
    assert counted(metrics, "Bidi", "RESOURCE_EXHAUSTED") == 1 and counted(metrics, "Bidi", "OK") == 1


@pytest.mark.parametrize("arity", ["ServerStream", "Bidi"])
async def test_a_stream_its_client_cancels_is_counted_as_cancelled(arity):
    async with serving() as (channel, metrics):
        kw = {"request_serializer": Chunk.SerializeToString, "response_deserializer": Chunk.FromString}
        path = f"/{SERVICE}/{arity}"
        if arity == "ServerStream":
            stream = channel.unary_stream(path, **kw)(Chunk(text="hang"), timeout=5)
        else:
            stream = channel.stream_stream(path, **kw)(iter([Chunk(text="hang")]), timeout=5)
        assert (await stream.read()).text == "first"
        stream.cancel()
        await eventually_async(lambda: counted(metrics, arity, "CANCELLED"), 2, every=0.01,
                               what="the cancelled call counted")
    assert counted(metrics, arity, "CANCELLED") == 1 and counted(metrics, arity, "UNKNOWN") == 0
