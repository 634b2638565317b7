"""The shared service runtime: health transitions, request context from metadata, metrics."""

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gaas.runtime.context import current_request_id, current_tenant, request_id_var
from gaas.runtime.server import ServerOptions, ServiceRuntime
from gaas.v1 import common_pb2, kvcache_pb2, kvcache_pb2_grpc, worker_pb2, worker_pb2_grpc


class EchoContext(kvcache_pb2_grpc.KVCacheServicer):
    """Answers GetStats with what the interceptor put in the context (request id length, tenant)."""

    seen: list = []

    async def GetStats(self, request, context):
        EchoContext.seen.append((current_request_id(), current_tenant()))
        return kvcache_pb2.DirectoryStats()


async def start(trust_tenant=True, metrics=False):
    rt = ServiceRuntime(
        ServerOptions(
            service="test", instance="test-0", port=0, metrics_port=0 if metrics else None,
            drain_seconds=0, grace_seconds=1, trust_tenant=trust_tenant,
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


@pytest.mark.parametrize("trust, expected_tenant", [(True, "acme"), (False, "")])
async def test_interceptor_sets_request_context(trust, expected_tenant):
    rt = await start(trust_tenant=trust)
    EchoContext.seen.clear()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            stub = kvcache_pb2_grpc.KVCacheStub(ch)
            md = (("x-gaas-request-id", "req-123"), ("x-gaas-tenant", "acme"))
            await stub.GetStats(kvcache_pb2.GetStatsRequest(), metadata=md, timeout=2)
            await stub.GetStats(kvcache_pb2.GetStatsRequest(), metadata=(("x-request-id", "envoy-1"),), timeout=2)
            await stub.GetStats(kvcache_pb2.GetStatsRequest(), timeout=2)
    finally:
        await rt.shutdown()
    (rid1, tenant1), (rid2, _), (rid3, tenant3) = EchoContext.seen
    assert (rid1, tenant1) == ("req-123", expected_tenant)
    assert rid2 == "envoy-1"  # Envoy's id when the caller sent none
    assert rid3.startswith("req-") and tenant3 == ""


async def test_metrics_endpoint_counts_calls():
    rt = await start(metrics=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            await kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.GetStatsRequest(), timeout=2)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kvcache_pb2_grpc.KVCacheStub(ch).Lookup(kvcache_pb2.LookupRequest(), timeout=2)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        port = rt._metrics_server.port
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    finally:
        await rt.shutdown()
    assert 'gaas_test_grpc_requests_total{code="OK",method="GetStats"} 1.0' in body
    assert 'gaas_test_grpc_requests_total{code="UNIMPLEMENTED",method="Lookup"} 1.0' in body
    assert "process_resident_memory_bytes" in body


async def test_port_in_use_is_a_clear_error():
    rt = await start()
    other = ServiceRuntime(ServerOptions(service="test", instance="test-1", port=rt.port, drain_seconds=0))
    try:
        with pytest.raises(Exception, match="port"):
            await other.start()
    finally:
        await rt.shutdown()


class MetadataEcho(worker_pb2_grpc.WorkerServicer):
    async def Generate(self, request, context):
        yield common_pb2.GenerateChunk(text=dict(context.invocation_metadata()).get("x-gaas-request-id", ""))

    async def GetLoad(self, request, context):
        return worker_pb2.WorkerLoad(worker_id=dict(context.invocation_metadata()).get("x-gaas-request-id", ""))


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
