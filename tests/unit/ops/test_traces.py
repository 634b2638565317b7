"""Traces (gaas.ops.traces, gaas.ops.tracesink, the Envoys' tracing) and the live view (gaas top),
without a mesh: trace endpoints and sampling checked, tracing only where asked, the collector stores
what the OpenTelemetry SDK exports and reads it back as parented traces, and a top frame's drawing."""

from __future__ import annotations

import json
import uuid

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gaas.cli import top
from gaas.envoy import config as envoyconf
from gaas.ops import traces
from gaas.ops.traces import TraceError, TraceTarget
from services.router.activity import TenantActivity
from tests.fakeclock import FakeClock

# ------------------------------------------------------------------ where spans go


@pytest.mark.parametrize("url, host, port", [
    ("http://collector:4317", "collector", 4317),
    ("http://127.0.0.1:14317", "127.0.0.1", 14317),
    ("collector", "collector", 4317),
    ("jaeger.local:4317", "jaeger.local", 4317),
])
def test_a_trace_endpoint_is_a_plaintext_otlp_grpc_receiver(url, host, port):
    t = TraceTarget.parse(url)
    assert (t.host, t.port, t.endpoint) == (host, port, f"http://{host}:{port}")


@pytest.mark.parametrize("url, says", [
    ("https://collector:4317", "plaintext"),
    ("grpc://collector", "plaintext"),
    ("http://collector:port", "not a number"),
    ("http://:4317", "names no host"),
])
def test_an_unusable_trace_endpoint_is_refused_with_what_to_give(url, says):
    with pytest.raises(TraceError, match=says):
        TraceTarget.parse(url)


@pytest.mark.parametrize("percent", [-1, 100.5])
def test_the_sampling_share_is_a_percentage(percent):
    with pytest.raises(TraceError, match="percentage"):
        TraceTarget.parse("http://c:4317", percent)


def _tracing(cfg: dict) -> list[dict]:
    found = []
    for listener in cfg["static_resources"]["listeners"]:
        for f in listener["filter_chains"][0]["filters"]:
            if "tracing" in f["typed_config"]:
                found.append(f["typed_config"]["tracing"])
    return found


def test_every_connection_manager_traces_only_when_asked_and_only_the_edge_starts_traces(tmp_path):
    from gaas.ops import pki, protogen, topology
    from tests.conftest import ROOT

    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=42000, workers=2)
    authority = pki.Authority(tmp_path)
    pki.issue_certificates(topo, authority)
    protogen.generate()
    plain = envoyconf.ingress_config(topo, protogen.DESCRIPTOR_SET, tmp_path, authority)
    assert _tracing(plain) == []
    assert envoyconf.OTLP_CLUSTER not in {c["name"] for c in plain["static_resources"]["clusters"]}

    target = TraceTarget("127.0.0.1", topo.trace_port, sample_percent=25)
    ingress = envoyconf.ingress_config(topo, protogen.DESCRIPTOR_SET, tmp_path, authority, trace=target)
    (edge,) = _tracing(ingress)
    sampler = edge["provider"]["typed_config"]["sampler"]
    assert sampler["name"].endswith("parent_based")  # a sampled caller's trace always continues
    assert sampler["typed_config"]["wrapped_sampler"]["typed_config"]["sampling_percentage"]["numerator"] == 250_000
    otlp = next(c for c in ingress["static_resources"]["clusters"] if c["name"] == envoyconf.OTLP_CLUSTER)
    assert otlp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1", "port_value": topo.trace_port}

    router = envoyconf.sidecar_config(topo, topo.instance("router-0"), tmp_path, authority, trace=target)
    tracing = _tracing(router)
    assert len(tracing) == 2  # inbound and outbound
    for t in tracing:
        root = t["provider"]["typed_config"]["sampler"]["typed_config"]["wrapped_sampler"]["typed_config"]
        assert root["sampling_percentage"]["numerator"] == 0  # no trace of its own: background calls
        assert t["provider"]["typed_config"]["service_name"] == "envoy-sidecar-router-0"


# ------------------------------------------------------------------ the collector


@pytest.fixture
def sink(tmp_path):
    """A running gaas.ops.tracesink (in this process) and an SDK tracer provider exporting to it."""
    from concurrent import futures

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from gaas.ops.tracesink import FileSink

    path = tmp_path / traces.TRACES_FILE
    store = FileSink(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def provider(service: str) -> TracerProvider:
        p = TracerProvider(resource=Resource.create({"service.name": service}))
        p.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True)))
        return p

    yield path, provider
    server.stop(0)
    store.close()


def test_the_collector_stores_what_the_sdk_exports_and_reads_it_back_as_one_parented_trace(sink):
    path, provider = sink
    front, back = provider("envoy-ingress"), provider("gaas-router")
    with front.get_tracer("t").start_as_current_span("ingress", attributes={"guid:x-request-id": "client-1"}) as root:
        with back.get_tracer("t").start_as_current_span("/gaas.v1.Inference/Generate") as child:
            child.set_attribute("gaas.worker", "worker-3")
            child.set_attribute("gaas.request_id", "req-1")
            with back.get_tracer("t").start_as_current_span("/gaas.v1.Worker/Generate"):
                pass
    front.shutdown()
    back.shutdown()
    # One OTLP/JSON export per line, ids in hex.
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all("resourceSpans" in d for d in lines)
    trace_hex = format(root.get_span_context().trace_id, "032x")
    collected = traces.load(path)
    t = collected[trace_hex]
    assert len(t.spans) == 3 and t.services() == ["envoy-ingress", "gaas-router"]
    (r,) = t.roots()
    assert r.name == "ingress" and r.children[0].name == "/gaas.v1.Inference/Generate"
    assert r.children[0].children[0].name == "/gaas.v1.Worker/Generate"
    assert t.request_ids() == {"client-1", "req-1"}
    # Found by id, by a prefix of it, or by either request id.
    for key in (trace_hex, trace_hex[:8], "req-1", "client-1"):
        assert traces.find(collected, key) is t
    with pytest.raises(TraceError, match="no trace"):
        traces.find(collected, "nope")
    drawn = traces.waterfall(t)
    assert "gaas-router: /gaas.v1.Inference/Generate" in drawn and "worker=worker-3" in drawn
    chrome = traces.chrome_events(t)
    assert sum(e["ph"] == "X" for e in chrome["traceEvents"]) == 3
    assert {e["args"]["name"] for e in chrome["traceEvents"] if e["ph"] == "M"} == {"envoy-ingress", "gaas-router"}


def test_the_collector_rotates_its_file_and_reading_keeps_the_previous_one(tmp_path):
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2

    from gaas.ops.tracesink import FileSink

    path = tmp_path / traces.TRACES_FILE
    store = FileSink(path, max_bytes=600)
    ids = []
    for i in range(12):
        tid = uuid.uuid4().bytes
        ids.append(tid.hex())
        req = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(scope_spans=[
            trace_pb2.ScopeSpans(spans=[trace_pb2.Span(trace_id=tid, span_id=bytes(8) + b"", name=f"s{i}",
                                                       start_time_unix_nano=i, end_time_unix_nano=i + 1)])])])
        store.Export(req, None)
    store.close()
    assert path.with_name(path.name + ".1").is_file()
    assert path.stat().st_size <= 600
    kept = traces.load(path)
    assert ids[-1] in kept and len(kept) < 12  # the oldest went with the file before the previous one


@given(st.lists(st.text(max_size=40), max_size=5))
def test_a_traces_file_with_torn_or_foreign_lines_is_read_without_failing(tmp_path_factory, junk):
    path = tmp_path_factory.mktemp("t") / traces.TRACES_FILE
    path.write_text("\n".join(junk) + '\n{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "ab", "spanId": "01"}]}]}]}\n{"resou')
    assert list(traces.load(path)) == ["ab"]


# ------------------------------------------------------------------ tenant activity and gaas top


def test_tenant_activity_counts_in_flight_and_the_last_minute_then_forgets():
    clock = FakeClock()
    a = TenantActivity(clock=clock, window=60)
    a.started("acme", "gold")
    a.started("acme", "gold")
    a.started("zed", "bronze")
    a.finished("acme", 100)
    clock.now = 30
    a.finished("zed", 10)
    snap = a.snapshot()
    assert [(t.tenant, t.in_flight, t.requests, t.tokens) for t in snap] == [("acme", 1, 1, 100), ("zed", 0, 1, 10)]
    clock.now = 61
    a.finished("acme", 5)
    # acme's first request left the minute; busiest first.
    assert [(t.tenant, t.in_flight, t.requests, t.tokens) for t in a.snapshot()] == [("zed", 0, 1, 10), ("acme", 0, 1, 5)]
    clock.now = 200
    assert a.snapshot() == []
    a.finished("ghost", 1)  # never started: ignored
    assert a.snapshot() == []


def test_a_top_frame_shows_each_worker_queue_band_and_the_busiest_tenants():
    health = {
        "ingress": "127.0.0.1:8080", "ingress_ready": True,
        "instances": [{"name": "worker-0", "health": "SERVING", "sidecar_ready": True},
                      {"name": "router-0", "health": "NOT_SERVING", "sidecar_ready": True}],
        "workers": [{"worker_id": "worker-0", "device": "cuda:0 NVIDIA H200", "state": "SERVING", "load": {
            "running": 3, "waiting": 1, "kv_cache_usage": 0.5, "device_memory_used": 2 * 2**30,
            "device_memory_total": 140 * 2**30, "device_utilization": 0.7, "adapters": ["bot"], "adapter_slots": 4}}],
        "autoscaled": [{"model": "tiny", "version": "1", "replicas": 2,
                        "autoscale": {"min": 0, "max": 4, "reason": "up: 9 requests per worker over 2 s"}}],
    }
    flows = [{"workers": [{"worker_id": "worker-0", "window": 8, "in_flight": 4, "breaker": "half_open"}],
              "bands": [{"band": "gold", "waiting": 2, "admitted": 5, "shed": 0, "timed_out": 1, "wait_p95_ms": 40.0}],
              "tenants": [{"tenant": f"t{i}", "tier": "gold", "in_flight": 0, "requests_1m": 1, "tokens_1m": 60 * i}
                          for i in range(12)]}]
    text = top.frame(health, flows, now=0)
    assert "not serving: router-0" in text
    worker = next(line for line in text.splitlines() if line.startswith("worker-0"))
    assert " 3    1" in worker and "50%" in worker and "4/8" in worker and "HALF_OPEN" in worker and "70%" in worker
    assert any(line.startswith("gold") and "40 ms" in line for line in text.splitlines())
    tenants = [line.split()[0] for line in text.splitlines() if line.startswith("t") and "gold" in line]
    assert tenants == [f"t{i}" for i in range(11, 1, -1)]  # the ten busiest, busiest first
    assert "... and 2 more" in text
    assert "LoRA 1/4 loaded: bot" in text
    assert "autoscaled tiny 1: 2 of 0-4 workers; last: up: 9 requests per worker over 2 s" in text
    empty = top.frame({"instances": [], "workers": []}, [], now=0)
    assert "(no worker registered)" in empty and "(no router answered)" in empty


# ------------------------------------------------------------------ the running mesh
