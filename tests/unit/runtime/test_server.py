"""The shared service runtime: health transitions, request context from metadata, metrics."""

import asyncio
import socket
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gaas.contracts import errors
from gaas.runtime import status
from gaas.runtime.context import client_request_id_var, current_request_id, current_tenant, request_id_var
from gaas.runtime.server import ServerOptions, ServiceRuntime
from gaas.v1 import common_pb2, kvcache_pb2, kvcache_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.waiting import eventually_async


class EchoContext(kvcache_pb2_grpc.KVCacheServicer):
    """GetStats records what the interceptor put in the context; Lookup raises what it is told to."""

    seen: list = []
    raise_next: BaseException | None = None

    async def GetStats(self, request, context):
        EchoContext.seen.append((current_request_id(), current_tenant(), client_request_id_var.get()))
        return kvcache_pb2.DirectoryStats()

    async def Lookup(self, request, context):
        raise EchoContext.raise_next


async def start(edge=False, metrics=False):
    rt = ServiceRuntime(
        ServerOptions(
            service="test", instance="test-0", port=0, metrics_port=0 if metrics else None,
            drain_seconds=0, grace_seconds=1, edge=edge,
        )
    )
    rt.add_service(kvcache_pb2_grpc.add_KVCacheServicer_to_server, EchoContext(), "gaas.v1.KVCache")
    await rt.start()
    return rt


async def health(port, service=""):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


async def test_health_follows_the_lifecycle():
    rt = await start()
    assert await health(rt.port) == "NOT_SERVING"
    await rt.set_serving(True)
    assert await health(rt.port) == "SERVING"
    assert await health(rt.port, "gaas.v1.KVCache") == "SERVING"
    stopped = []

    async def hook():
        # Stop hooks run after NOT_SERVING, while the port still answers.
        stopped.append(await health(rt.port))

    rt.on_stop(hook)
    await rt.shutdown()
    assert stopped == ["NOT_SERVING"]


async def three_calls(rt):
    EchoContext.seen.clear()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
        stub = kvcache_pb2_grpc.KVCacheStub(ch)
        md = (("x-gaas-request-id", "req-123"), ("x-gaas-tenant", "acme"))
        await stub.GetStats(kvcache_pb2.GetStatsRequest(), metadata=md, timeout=2)
        await stub.GetStats(kvcache_pb2.GetStatsRequest(), metadata=(("x-request-id", "client-1 " + "x" * 300),), timeout=2)
        await stub.GetStats(kvcache_pb2.GetStatsRequest(), timeout=2)
    return EchoContext.seen


async def test_inside_the_mesh_the_interceptor_believes_gaas_metadata():
    rt = await start(edge=False)
    try:
        (rid1, tenant1, _), (rid2, _, client2), (rid3, tenant3, _) = await three_calls(rt)
    finally:
        await rt.shutdown()
    assert (rid1, tenant1) == ("req-123", "acme")
    assert rid2 == client2 == "client-1" + "x" * 120  # Envoy's id when the caller sent none, cut and cleaned
    assert rid3.startswith("req-") and tenant3 == ""


async def test_at_the_edge_no_caller_chooses_the_request_id_or_tenant():
    rt = await start(edge=True)
    try:
        (rid1, tenant1, _), (rid2, _, client2), (rid3, _, _) = await three_calls(rt)
    finally:
        await rt.shutdown()
    assert rid1.startswith("req-") and rid1 != "req-123" and tenant1 == ""
    assert rid2.startswith("req-") and client2 == "client-1" + "x" * 120, "the client's id is kept for the logs only"
    assert len({rid1, rid2, rid3}) == 3


async def call_lookup(rt, raise_next):
    EchoContext.raise_next = raise_next
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kvcache_pb2_grpc.KVCacheStub(ch).Lookup(kvcache_pb2.LookupRequest(), timeout=2)
    return err.value


async def test_domain_errors_become_their_status_with_details():
    rt = await start()
    try:
        err = await call_lookup(rt, errors.ResourceExhausted(
            "over quota", param="max_tokens", reason="quota", retry_after=1.5,
            quota=errors.QuotaViolation("tenant:acme", "requests per minute: 60")))
        big = await call_lookup(rt, errors.InvalidArgument("x" * 100_000))
    finally:
        await rt.shutdown()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == "over quota"
    back = status.from_rpc(err)
    assert isinstance(back, errors.ResourceExhausted)
    assert (back.param, back.reason, back.retry_after) == ("max_tokens", "quota", 1.5)
    assert back.quota == errors.QuotaViolation("tenant:acme", "requests per minute: 60")
    assert big.code() == grpc.StatusCode.INVALID_ARGUMENT and len(big.details()) <= errors.MAX_MESSAGE_CHARS


async def test_an_unavailable_without_a_delay_still_tells_the_client_when_to_retry():
    rt = await start()
    try:
        err = await call_lookup(rt, errors.Unavailable("no worker could take the request right now; retry shortly"))
    finally:
        await rt.shutdown()
    back = status.from_rpc(err)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert isinstance(back, errors.Unavailable) and back.retry_after == errors.UNAVAILABLE_RETRY_S == 1.0
    assert errors.Unavailable("busy", retry_after=4.0).retry_after == 4.0


async def test_unexpected_failures_are_internal_without_their_text():
    rt = await start()
    try:
        err = await call_lookup(rt, KeyError("secret-table-name"))
    finally:
        await rt.shutdown()
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "secret-table-name" not in err.details() and "internal error (request id req-" in err.details()


async def test_a_malformed_message_is_invalid_argument_not_internal():
    rt = await start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            raw = ch.unary_unary("/gaas.v1.KVCache/Lookup", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(b"\xff\xff\xff", timeout=2)
    finally:
        await rt.shutdown()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid LookupRequest" in err.value.details()


async def test_metrics_endpoint_counts_calls():
    rt = await start(metrics=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            await kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.GetStatsRequest(), timeout=2)
            EchoContext.raise_next = errors.NotFound("no such thing")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kvcache_pb2_grpc.KVCacheStub(ch).Lookup(kvcache_pb2.LookupRequest(), timeout=2)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        port = rt._metrics_server.port

        async def counted() -> str | None:
            # (a failed call is counted as its handler ends, just after its status reached the client)
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
            return body if 'method="Lookup"' in body else None

        body = await eventually_async(counted, 5, every=0.05, what="the failed call counted")
    finally:
        await rt.shutdown()
    assert 'gaas_test_grpc_requests_total{code="OK",method="GetStats"} 1.0' in body
    assert 'gaas_test_grpc_requests_total{code="NOT_FOUND",method="Lookup"} 1.0' in body
    assert "process_resident_memory_bytes" in body


async def test_port_in_use_is_a_clear_error():
    rt = await start()
    other = ServiceRuntime(ServerOptions(service="test", instance="test-1", port=rt.port, drain_seconds=0))
    try:
        with pytest.raises(OSError, match="is in use"):
            await other.start()
    finally:
        await rt.shutdown()


async def test_a_metrics_port_in_use_is_a_clear_error_naming_it():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    rt = ServiceRuntime(ServerOptions(service="test", instance="test-0", port=0, metrics_port=port, drain_seconds=0))
    rt.add_service(kvcache_pb2_grpc.add_KVCacheServicer_to_server, EchoContext(), "gaas.v1.KVCache")
    try:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}: Address already in use"):
            await rt.start()
    finally:
        taken.close()


async def test_a_unix_socket_left_by_a_killed_instance_is_taken_over_but_a_live_one_is_not(tmp_path):
    sock = tmp_path / "service.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()  # the file stays, nobody listens: what kill -9 leaves
    rt = ServiceRuntime(ServerOptions(service="test", instance="test-0", listen=f"unix:{sock}", drain_seconds=0))
    rt.add_service(kvcache_pb2_grpc.add_KVCacheServicer_to_server, EchoContext(), "gaas.v1.KVCache")
    await rt.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
            await kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.GetStatsRequest(), timeout=2)
        second = ServiceRuntime(ServerOptions(service="test", instance="test-1", listen=f"unix:{sock}", drain_seconds=0))
        with pytest.raises(OSError, match="is in use"):
            await second.start()
    finally:
        await rt.shutdown()


class MetadataEcho(worker_pb2_grpc.WorkerServicer):
    async def Generate(self, request, context):
        yield common_pb2.GenerateChunk(text=dict(context.invocation_metadata()).get("x-gaas-request-id", ""))

    async def GetLoad(self, request, context):
        return common_pb2.WorkerLoad(worker_id=dict(context.invocation_metadata()).get("x-gaas-request-id", ""))


async def test_runtime_channels_carry_the_request_id_on_every_call_kind():
    rt = ServiceRuntime(ServerOptions(service="test", instance="test-0", port=0, drain_seconds=0, grace_seconds=1))
    rt.add_service(worker_pb2_grpc.add_WorkerServicer_to_server, MetadataEcho(), "gaas.v1.Worker")
    await rt.start()
    channel = rt.channel(f"127.0.0.1:{rt.port}")
    try:
        token = request_id_var.set("req-propagated")
        stub = worker_pb2_grpc.WorkerStub(channel)
        unary = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
        streamed = [c.text async for c in stub.Generate(worker_pb2.WorkerGenerateRequest(), timeout=2)]
        request_id_var.reset(token)
    finally:
        await channel.close()
        await rt.shutdown()
    assert unary.worker_id == "req-propagated"
    assert streamed == ["req-propagated"]


async def test_tracing_instruments_servers_and_channels_only_when_configured():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gaas.runtime import telemetry

    off = telemetry.make_tracer_provider("t", "t-0")  # no OTEL_EXPORTER_OTLP_ENDPOINT in tests
    assert isinstance(off, trace.NoOpTracerProvider)
    assert telemetry.server_interceptors(off) == [] and telemetry.client_interceptors(off) == []

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    server = grpc.aio.server(interceptors=telemetry.server_interceptors(provider))
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(EchoContext(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=telemetry.client_interceptors(provider)
        ) as ch:
            await kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.GetStatsRequest(), timeout=2)
    finally:
        await server.stop(0)
    kinds = sorted(s.kind.name for s in spans.get_finished_spans())
    assert kinds == ["CLIENT", "SERVER"]


def test_a_stream_closed_under_its_handler_counts_as_cancelled_not_unknown():
    import asyncio

    from gaas.runtime.interceptors import _status_of

    class Context:
        def code(self):
            return None

    assert _status_of(GeneratorExit(), Context()) == "CANCELLED"
    assert _status_of(asyncio.CancelledError(), Context()) == "CANCELLED"
    assert _status_of(RuntimeError("boom"), Context()) == "UNKNOWN"
    assert _status_of(None, Context()) == "OK"
