"""The whole mesh, started once by `gaas up` (Redis, five services, two vLLM workers, six
sidecars and the ingress Envoy): requests travel the real path and come back as they should."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest
import redis

from gaas.ops import pki
from gaas.v1 import (
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.conftest import INGRESS_PATH, MESH_WORKERS, ROOT, process_alive
from tests.meshutil import gaas, generate, http, wait_for_lines, wait_workers_idle, worker_addresses
from tests.waiting import eventually, eventually_async

pytestmark = pytest.mark.mesh

# Tests that count tokens decode greedily: a random sample could pick the end-of-text token early.
GREEDY = common_pb2.SamplingParams(temperature=0)
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # several 32-token blocks


def test_ready_report_and_status(mesh):
    assert mesh.ready["healthy"] and mesh.ready["ingress"] == mesh.ingress
    assert len(mesh.ready["workers"]) == MESH_WORKERS
    r = gaas(mesh, "status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    status = json.loads(r.stdout)
    assert {i["name"] for i in status["instances"]} >= {"control-0", "router-0", "worker-0", "worker-1"}
    assert all(i["health"] == "SERVING" and i["sidecar_ready"] for i in status["instances"])
    assert {w["backend"] for w in status["workers"]} <= {"vllm-cpu", "vllm-cuda"}
    human = gaas(mesh, "status")
    assert "registered workers" in human.stdout and "SERVING" in human.stdout


def test_grpc_generation_streams_tokens_through_the_ingress(mesh):
    chunks = generate(mesh, prompt="Once upon a time", max_tokens=12, sampling=GREEDY)
    assert len(chunks) >= 2, "tokens should arrive as a stream, not one message"
    final = chunks[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 12 == final.usage.completion_tokens
    assert final.usage.prompt_tokens > 0
    assert final.model == "gaas-tiny" and final.model_version == "1.0.0"
    assert final.worker_id in worker_addresses(mesh)
    assert final.timings.ttft_ms > 0 and final.timings.engine_ms >= final.timings.ttft_ms
    assert all(c.request_id == final.request_id for c in chunks) and final.request_id
    # Greedy decoding is deterministic: the same prompt gives the same text on any worker.
    again = generate(mesh, prompt="Once upon a time", max_tokens=12, sampling=GREEDY)
    assert "".join(c.text for c in again) == "".join(c.text for c in chunks)


def test_token_id_prompts(mesh):
    chunks = generate(mesh, prompt_token_ids=[1, 50, 60, 70], max_tokens=5, sampling=GREEDY)
    assert chunks[-1].usage.prompt_tokens == 4
    assert chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("keep", [False, True])
def test_stop_strings_end_the_text(mesh, keep):
    """Greedy decoding is deterministic: a stop string taken from the middle of the full text must
    cut it at its first occurrence (kept in the text only when asked)."""
    full = "".join(c.text for c in generate(mesh, prompt="Once upon a time", max_tokens=16, sampling=GREEDY))
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3, full
    sampling = common_pb2.SamplingParams(temperature=0, include_stop_str_in_output=keep)
    chunks = generate(mesh, prompt="Once upon a time", max_tokens=16, sampling=sampling, stop=[stop])
    text = "".join(c.text for c in chunks)
    cut = full.find(stop)
    assert text == (full[: cut + len(stop)] if keep else full[:cut])
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP and chunks[-1].stop_reason == stop


def test_n_choices_and_logprobs_on_the_native_api(mesh):
    chunks = generate(mesh, prompt="Once upon a time", max_tokens=4, n=3, logprobs=2, sampling=common_pb2.SamplingParams(seed=1))
    by_choice = {i: [c for c in chunks if c.index == i] for i in range(3)}
    assert all(sum(len(c.token_ids) for c in cs) == 4 for cs in by_choice.values())
    assert all(cs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH for cs in by_choice.values())
    assert chunks[-1].usage.completion_tokens == 12 and [c.HasField("usage") for c in chunks].count(True) == 1
    entries = [e for c in chunks for e in c.logprobs]
    assert len(entries) == 12 and all(e.logprob <= 0 and len(e.top) >= 2 for e in entries)


def test_concurrent_requests_spread_over_the_workers(mesh):
    """Requests the router just sent count against a worker before its next load report."""
    from concurrent.futures import ThreadPoolExecutor

    sampling = common_pb2.SamplingParams(ignore_eos=True)
    wait_workers_idle(mesh)
    with ThreadPoolExecutor(4) as pool:
        finals = list(pool.map(lambda i: generate(mesh, prompt=f"spread {i}", max_tokens=200, sampling=sampling)[-1],
                               range(4)))
    assert {f.worker_id for f in finals} == set(worker_addresses(mesh))


def test_prefix_cache_hit_is_reported(mesh):
    cached = [generate(mesh, prompt=LONG_PROMPT, max_tokens=2)[-1].usage for _ in range(MESH_WORKERS + 1)]
    assert cached[0].prompt_tokens >= 64
    # The repeats land on the worker that has seen the prompt: whole blocks come from its cache.
    assert min(u.cached_tokens for u in cached[1:]) >= 32


def test_http_json_through_the_ingress(mesh):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "sampling": {"temperature": 0}}
    status, body = http(mesh, "/v1/generate", json.dumps(body).encode())
    assert status == 200, body
    lines = [json.loads(line) for line in body.strip().splitlines()]
    assert len(lines) >= 2
    assert lines[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert lines[-1]["usage"]["completion_tokens"] == 6
    status, body = http(mesh, "/v1/gaas/models", method="GET")
    assert status == 200
    models = {m["name"]: m for m in json.loads(body)["models"]}
    assert models["gaas-tiny"]["ready_workers"] == MESH_WORKERS


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b'{"prompt": "x", "model": "gpt-9"}', 404, "model 'gpt-9' does not exist"),
        (b'{"prompt": ""}', 400, "exactly one of prompt"),
        (b'{"prompt": "x", "max_tokens": 999999}', 400, "context of 2048"),
        (b'{"prompt": "x", "sampling": {"temperature": -3}}', 400, "'temperature' must be at least 0"),
        (b'{"prompt": ', 400, ""),
        (b'{"prompt": 5}', 400, ""),
    ],
)
def test_http_errors_are_clear(mesh, body, status, message):
    got, text = http(mesh, "/v1/generate", body)
    assert got == status, text
    assert message in text


def test_unknown_http_path_is_404(mesh):
    assert http(mesh, "/v2/anything", b"{}")[0] == 404


@pytest.mark.parametrize(
    "req, code",
    [
        ({"prompt": "x", "model": "nope"}, grpc.StatusCode.NOT_FOUND),
        ({"prompt": "x", "prompt_token_ids": [1]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt_token_ids": [99999999]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "x", "model": "gaas-small"}, grpc.StatusCode.UNAVAILABLE),  # deployed, but no worker serves it
    ],
)
def test_grpc_errors_carry_the_right_code(mesh, req, code):
    with pytest.raises(grpc.RpcError) as err:
        generate(mesh, **req)
    assert err.value.code() == code, err.value.details()
    assert err.value.details()


def test_forged_worker_header_from_outside_is_ignored(mesh):
    """The ingress strips x-gaas-worker: a client cannot aim the router's sidecar anywhere."""
    chunks = generate(mesh, metadata=mesh.auth + (("x-gaas-worker", "127.0.0.1:1"),), prompt="hi", max_tokens=2)
    assert chunks[-1].worker_id in worker_addresses(mesh)


def test_the_router_sidecar_reaches_only_the_meshs_own_workers(mesh):
    """x-gaas-worker picks one of the mesh's workers; any other host:port has nowhere to go."""
    from gaas.ops.topology import LocalSockets, sockets_root

    outbound = LocalSockets.of(sockets_root(mesh.run_dir.resolve()), "router-0").outbound
    with grpc.insecure_channel(f"unix:{outbound}") as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        real = next(iter(worker_addresses(mesh).values()))
        # The real worker answers (an empty request is the worker's to refuse).
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(worker_pb2.WorkerGenerateRequest(), timeout=5, metadata=(("x-gaas-worker", real),)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        for elsewhere in ("127.0.0.1:1", f"127.0.0.1:{mesh.port_base + 1}", "10.0.0.1:443"):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(worker_pb2.WorkerGenerateRequest(), timeout=5, metadata=(("x-gaas-worker", elsewhere),)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, elsewhere


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer gaas_not_a_key"),)])
def test_grpc_needs_a_valid_key(mesh, metadata):
    with pytest.raises(grpc.RpcError) as err:
        generate(mesh, metadata=metadata, prompt="hi", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_cancelled_stream_aborts_the_engine_request(mesh):
    async with grpc.aio.insecure_channel(mesh.ingress) as ch:
        call = inference_pb2_grpc.InferenceStub(ch).Generate(
            inference_pb2.GenerateRequest(prompt="Tell me everything", max_tokens=1500), timeout=60, metadata=mesh.auth
        )
        first = None
        async for chunk in call:
            first = chunk
            break
        call.cancel()
    assert first is not None
    # Every worker's engine is idle again shortly after (asked through each worker's sidecar).
    for wid, address in worker_addresses(mesh).items():
        async with pki.operator_channel(address, aio=True) as wch:
            stub = worker_pb2_grpc.WorkerStub(wch)

            async def idle() -> bool:
                load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
                return load.running_requests == 0 and load.waiting_requests == 0

            await eventually_async(idle, 5, every=0.05, what=f"{wid} done with the cancelled request")


def test_workers_hold_leases_in_redis(mesh):
    r = redis.Redis.from_url(json.loads((mesh.run_dir / "mesh.json").read_text())["redis_url"])
    for wid in worker_addresses(mesh):
        lease_left = r.zscore("gaas:workers", wid) - time.time() * 1000
        assert 0 < lease_left <= 10_000, f"{wid}: lease ends in {lease_left} ms"
    r.close()


def test_the_launched_redis_asks_for_a_password_and_secrets_are_owner_only(mesh):
    from urllib.parse import urlparse

    url = json.loads((mesh.run_dir / "mesh.json").read_text())["redis_url"]
    u = urlparse(url)
    assert u.password, "gaas up started Redis without a password"
    anonymous = redis.Redis(host=u.hostname, port=u.port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    for name in ("redis-password", "mesh.json", "demo-key", "control.db", "billing.db", "redis/redis.conf"):
        path = mesh.run_dir / name
        if path.exists():
            assert path.stat().st_mode & 0o077 == 0, f"{name} is readable by others: {oct(path.stat().st_mode)}"
    assert (mesh.run_dir / "redis-password").exists()


def test_cli_generate_prints_text_and_stats(mesh):
    r = gaas(mesh, "generate", "Once upon a time", "--max-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "TTFT" in r.stderr and "8 tokens" in r.stderr and "tokens/s" in r.stderr
    assert r.stdout.strip()
    j = gaas(mesh, "generate", "Once upon a time", "--max-tokens", "4", "--temperature", "0", "--json")
    summary = json.loads(j.stdout)
    assert summary["tokens"] == 4 and summary["usage"]["completion_tokens"] == 4 and summary["ttft_ms"] > 0
    bad = gaas(mesh, "generate", "x", "--model", "nope")
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr
    models = json.loads(gaas(mesh, "models", "--json").stdout)
    assert {m["name"] for m in models} == {"gaas-tiny", "gaas-small", "gaas-long", "gaas-embed"}


def test_services_expose_metrics(mesh):
    from gaas.ops import topology

    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=mesh.port_base, workers=MESH_WORKERS)
    router = topo.instance("router-0")
    body = urllib.request.urlopen(f"http://{router.host}:{router.metrics_port}/metrics", timeout=5).read().decode()
    # Through the router it serves the generations; on the direct path it decides them at the ingress.
    method = "Process" if INGRESS_PATH == "direct" else "Generate"
    assert f'gaas_router_grpc_requests_total{{code="OK",method="{method}"}}' in body
    worker = topo.instance("worker-0")
    body = urllib.request.urlopen(f"http://{worker.host}:{worker.metrics_port}/metrics", timeout=5).read().decode()
    assert "gaas_worker_grpc_requests_total" in body and "vllm:" in body  # vLLM's own metrics too


def test_access_logs_show_the_path_under_gaas_own_id(mesh):
    final = generate(mesh, metadata=mesh.auth + (("x-request-id", "client-trace-me"),), prompt="trace me",
                     max_tokens=2, request_id="client-body-id")[-1]
    rid = final.request_id
    assert rid.startswith("req-") and "client" not in rid, "GaaS names requests itself"
    logs = mesh.run_dir / "logs"
    wait_for_lines(logs / "envoy-ingress-access.log", "/gaas.v1.Inference/Generate", "client-trace-me")
    # Through the router, its sidecar carries the call to the worker; on the direct path the ingress
    # sends it to the worker itself, under the id the router gave it at the ingress.
    worker_call = "/gaas.v1.Inference/Generate" if INGRESS_PATH == "direct" else "/gaas.v1.Worker/Generate"
    wait_for_lines(logs / f"envoy-{final.worker_id}-access.log", rid, worker_call)
    router_sidecar = wait_for_lines(logs / "envoy-router-0-access.log", "/gaas.v1.Control/")
    assert "Health/Check" not in router_sidecar  # health checks are filtered out
    if INGRESS_PATH == "direct":
        # The ingress's log names both ids (the client's, and GaaS's as the router set it there).
        line = wait_for_lines(logs / "envoy-ingress-access.log", rid, "client-trace-me")
        assert any(json.loads(x).get("envoy_request_id") == "client-trace-me" for x in line.splitlines() if rid in x)
        return
    # The router's log names both ids, so a client's id leads to GaaS's.
    line = wait_for_lines(logs / "router-0.log", rid, "client-trace-me")
    assert any(json.loads(x).get("client_request_id") == "client-trace-me" for x in line.splitlines() if rid in x)


@pytest.mark.destructive
def test_a_dead_worker_is_routed_around(mesh):
    try:
        os.killpg(json.loads((mesh.run_dir / "mesh.json").read_text())["children"]["worker-1"], signal.SIGKILL)
    except ProcessLookupError:
        pass  # an earlier destructive test already took it down
    # Until its lease lapses the router may still pick it: the stream is retried on worker-0.
    for i in range(4):
        chunks = generate(mesh, prompt=f"still there {i}", max_tokens=2)
        assert chunks[-1].worker_id == "worker-0"
    def registered() -> list[str]:
        with pki.operator_channel(mesh.ready["instances"][0]["address"]) as ch:  # control-0's sidecar
            workers = control_pb2_grpc.ControlStub(ch).ListWorkers(control_pb2.ListWorkersRequest(), timeout=2).workers
        return [w.worker_id for w in workers]

    eventually(lambda: registered() == ["worker-0"], 20, every=0.5, what="worker-1's lease lapsed")


@pytest.mark.destructive
def test_sigterm_stops_everything(mesh):
    rc = mesh.stop(timeout=90)
    assert rc == 0, mesh.output.read_text()[-3000:]
    eventually(lambda: not any(process_alive(pid) for pid in mesh.children.values()), 5, every=0.1,
               what=lambda: f"every process gone (alive: {[n for n, p in mesh.children.items() if process_alive(p)]})")
    # vLLM's engine processes lived in the workers' process groups: none may remain.
    leftovers = subprocess.run(["pgrep", "-f", str(mesh.run_dir)], capture_output=True, text=True).stdout.split()
    assert leftovers == []
    assert "stopped; nothing left running" in mesh.output.read_text()
