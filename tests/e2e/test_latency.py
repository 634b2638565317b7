"""Where a request's time went, on the running mesh: the decomposition returned on the last chunk
(gRPC), in usage.gaas_latency_ms (OpenAI routes, on request), printed by `gaas generate --explain`, and
recorded as the router's histograms; a client cannot forge the ingress's stamp."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc

from gaas.contracts import latency
from gaas.runtime.context import INGRESS_START_HEADER
from gaas.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import MESH_WORKERS, ROOT
from tests.meshutil import gaas, http, wait_for_lines


def _timed_generate(mesh, request_id: str = "", **req):
    md = mesh.auth + ((("x-request-id", request_id),) if request_id else ())
    with grpc.insecure_channel(mesh.ingress) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        stub.Generate(inference_pb2.GenerateRequest(prompt="warm", max_tokens=1), timeout=60, metadata=mesh.auth)
        started = time.perf_counter()
        chunks = list(stub.Generate(inference_pb2.GenerateRequest(**req), timeout=60, metadata=md))
        return chunks, (time.perf_counter() - started) * 1000


def test_every_request_says_where_its_time_went_and_the_parts_add_up(mesh):
    rid = f"explain-{time.time_ns()}"
    chunks, client_ms = _timed_generate(mesh, rid, prompt="Where does the time go?", max_tokens=64)
    t = chunks[-1].timings
    parts = {p: latency.part_ms(t, p) for p in latency.PARTS}
    assert all(v >= 0 for v in parts.values()), parts
    assert abs(sum(parts.values()) - t.total_ms) < 0.01
    assert parts["decode"] > 0 and parts["prefill"] > 0 and parts["net"] > 0 and parts["tenant"] > 0
    assert t.queue_ms >= t.router_queue_ms
    # Writing the usage event after the last token is the tenant's, not the first token's.
    assert 0 < t.usage_ms <= t.tenant_ms
    assert 0 < latency.first_token_ms(t) <= t.total_ms - t.decode_ms - t.usage_ms + 0.01
    # Against the end-to-end time measured independently at the edge: the ingress Envoy's own
    # duration of this request (its arrival to the last byte it sent back, whole milliseconds). The
    # parts cover it but for the last chunk's way back out: within 5%.
    line = wait_for_lines(mesh.run_dir / "logs" / "envoy-ingress-access.log", rid)
    edge_ms = next(json.loads(x)["duration_ms"] for x in line.splitlines() if rid in x)
    assert 0.95 * edge_ms <= t.total_ms <= edge_ms + 1, (t.total_ms, edge_ms, parts)
    assert t.total_ms <= client_ms


def test_the_openai_routes_explain_on_request(mesh):
    body = json.dumps({"model": "gaas-tiny", "prompt": "explain", "max_tokens": 8}).encode()
    status, plain = http(mesh, "/v1/completions", body)
    assert status == 200 and "gaas_latency_ms" not in json.loads(plain)["usage"]
    status, explained = http(mesh, "/v1/completions", body, headers=[("x-gaas-explain", "1")])
    got = json.loads(explained)["usage"]["gaas_latency_ms"]
    assert set(got) == {*latency.PARTS, "total", "ttft"}
    assert abs(sum(got[p] for p in latency.PARTS) - got["total"]) < 0.01
    assert 0 < got["ttft"] <= got["total"] - got["decode"]

    stream = json.dumps({"model": "gaas-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                         "stream": True}).encode()
    status, events = http(mesh, "/v1/chat/completions", stream, headers=[("x-gaas-explain", "true")])
    usage = [json.loads(e[6:]) for e in events.split("\n\n") if e.startswith("data: {")][-1]["usage"]
    assert usage["gaas_latency_ms"]["total"] > 0


def test_a_client_cannot_forge_the_ingress_stamp(mesh):
    chunks, client_ms = _timed_generate(mesh, prompt="forged", max_tokens=4)
    with grpc.insecure_channel(mesh.ingress) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        forged = list(stub.Generate(inference_pb2.GenerateRequest(prompt="forged", max_tokens=4), timeout=60,
                                    metadata=mesh.auth + ((INGRESS_START_HEADER, f"{time.time() - 30:.6f}"),)))
    assert forged[-1].timings.net_ms < 1000  # the ingress's own stamp, not the client's 30 s


def test_gaas_generate_explain_prints_the_parts(mesh):
    out = gaas(mesh, "generate", "--explain", "--max-tokens", "8", "Hello")
    assert out.returncode == 0, out.stderr
    assert "where the time went" in out.stderr
    for part in latency.PARTS:
        assert f"   {part}" in out.stderr
    js = gaas(mesh, "generate", "--json", "--max-tokens", "4", "Hello")
    assert set(json.loads(js.stdout)["latency_ms"]) == {*latency.PARTS, "total", "ttft"}


def test_the_router_records_the_parts_as_histograms_by_tier(mesh):
    from gaas.ops import topology

    _timed_generate(mesh, prompt="metrics", max_tokens=4)
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=mesh.port_base, workers=MESH_WORKERS)
    router = topo.instance("router-0")
    body = urllib.request.urlopen(f"http://{router.host}:{router.metrics_port}/metrics", timeout=5).read().decode()
    for part in (*latency.PARTS, "total"):
        assert f'gaas_router_request_latency_seconds_count{{part="{part}",tier="gold"}}' in body, part
    assert 'gaas_router_request_latency_seconds_bucket{le="0.0001",part="router",tier="gold"}' in body
    # Request-level figures, by model and tier (tenant names never: their number is not bounded).
    assert 'gaas_router_requests_total{model="gaas-tiny",outcome="length",tier="gold"}' in body
    for kind in ("prompt", "completion", "cached"):
        assert f'gaas_router_tokens_total{{kind="{kind}",model="gaas-tiny",tier="gold"}}' in body
    assert 'gaas_router_time_to_first_token_seconds_count{model="gaas-tiny",tier="gold"}' in body
    assert 'gaas_router_time_per_output_token_seconds_count{model="gaas-tiny",tier="gold"}' in body
    assert "tenant=" not in body.split("gaas_router_requests_total")[1].split("\n# HELP")[0]
    # The router's view of each worker, from its load reports.
    assert 'gaas_router_worker_running_requests{model="gaas-tiny",worker="worker-0"}' in body
    assert 'gaas_router_worker_kv_cache_usage{model="gaas-tiny",worker="worker-0"}' in body
