"""What one decision call costs the router, by how its sidecar reaches it: grpc.aio (a gRPC server)
or the router's HTTP/1.1 front (services/router/extproc_http.py, what the mesh runs).

One Envoy plays the ingress and the router's sidecar: a listener taking HTTP/1.1 requests through
the ingress's ext_proc filter as the mesh renders it (gaas.envoy.direct.ext_proc: headers and the
whole body, full duplex) to a second listener, which forwards the call to the processor on a Unix
socket over HTTP/2 (grpc.aio) or HTTP/1.1 with trailers (gaas.envoy.clusters.pipe_cluster); the
request is then answered by Envoy itself. The processor is the same trivial one in both (it answers
the headers and the body, as the router's decision does, and decides nothing), so the difference
is the call's machinery alone. Requests one at a time, in alternating rounds; the processor's and
Envoy's CPU per call (from /proc) and the round trip's p50.

Prints a table and writes bench/results/extproc_call.json.

    python -m bench.extproc_call [--calls 1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.output import RESULTS, progress, write_json
from bench.common.stats import percentile

say = progress("extproc-call")
MODES = ("grpc.aio", "http/1.1")


class Trivial:
    """Answers the headers and the body once both came, as the router's decision does."""

    async def process(self, requests):
        from gaas.v1 import ext_proc_pb2 as ep

        async for r in requests:
            if r.WhichOneof("request") == "request_body" and r.request_body.end_of_stream:
                break
        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=[ep.HeaderValueOption(
                header=ep.HeaderValue(key="x-gaas-worker", raw_value=b"127.0.0.1:1"))]), clear_route_cache=True)))
        yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=b"{}", end_of_stream=True)))))


async def _serve(mode: str, sock: str) -> None:
    """The processor, until killed."""
    if mode == "grpc.aio":
        import grpc

        from gaas.v1 import ext_proc_pb2 as ep

        trivial = Trivial()

        async def process(requests, context):
            async for r in trivial.process(requests):
                yield r

        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": grpc.stream_stream_rpc_method_handler(
                process, ep.ProcessingRequest.FromString, ep.ProcessingResponse.SerializeToString)})])
        server.add_insecure_port(f"unix:{sock}")
        await server.start()
    else:
        from gaas.runtime.metrics import ServiceMetrics
        from services.router.extproc_http import ExtProcFront

        await ExtProcFront(Trivial(), ServiceMetrics("bench"), 1 << 20).start(f"unix:{sock}")
    print("ready", flush=True)
    await asyncio.Event().wait()


def envoy_config(mode: str, sock: str, front: int, side: int, admin: int) -> dict:
    from gaas.envoy.clusters import HTTP2, pipe_cluster
    from gaas.envoy.direct import ext_proc

    def hcm(name: str, route: dict, filters: list) -> dict:
        return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                     ".HttpConnectionManager",
            "stat_prefix": name, "codec_type": "AUTO",
            "route_config": {"virtual_hosts": [{"name": name, "domains": ["*"],
                                                "routes": [{"match": {"prefix": "/"}, **route}]}]},
            "http_filters": [*filters, {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}

    def listener(name: str, port: int, manager: dict) -> dict:
        return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [manager]}]}

    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {
                "listeners": [
                    listener("ingress", front, hcm("ingress", {"direct_response": {"status": 200}}, [ext_proc()])),
                    listener("sidecar", side, hcm("sidecar", {"route": {"cluster": "local", "timeout": "0s"}}, [])),
                ],
                "clusters": [
                    {"name": "router", "type": "STATIC", "connect_timeout": "1s", "typed_extension_protocol_options": HTTP2,
                     "load_assignment": {"cluster_name": "router", "endpoints": [{"lb_endpoints": [{"endpoint": {
                         "address": {"socket_address": {"address": "127.0.0.1", "port_value": side}}}}]}]}},
                    pipe_cluster("local", Path(sock), http1=mode == "http/1.1"),
                ]}}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def measure(mode: str, calls: int, tmp: Path) -> dict:
    from gaas.envoy.binary import envoy_binary
    from gaas.launcher.rundir import free_port_base

    base = free_port_base(span=3, start=29500)
    sock = str(tmp / f"{mode.replace('/', '')}.sock")
    config = tmp / f"envoy-{mode.replace('/', '')}.json"
    config.write_text(json.dumps(envoy_config(mode, sock, base, base + 1, base + 2)))
    proc = subprocess.Popen([sys.executable, "-m", "bench.extproc_call", "--serve", mode, sock],
                            stdout=subprocess.PIPE, text=True)
    envoy = subprocess.Popen([str(envoy_binary()), "-c", str(config), "--concurrency", "1", "-l", "error",
                              "--disable-hot-restart"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline().strip() == "ready", f"the {mode} processor did not start"
        body = json.dumps({"model": "gaas-tiny", "prompt": "x" * 512, "max_tokens": 32}).encode()
        conn = None
        for _ in range(100):  # Envoy listening, then warm
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", base, timeout=10)
                conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
                response = conn.getresponse()
                response.read()
                if response.status == 200:
                    continue
            except OSError:
                conn = None
                time.sleep(0.1)
        latencies = []
        before = cpu_seconds(proc.pid), cpu_seconds(envoy.pid)
        for _ in range(calls):
            started = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            response = conn.getresponse()
            response.read()
            latencies.append(time.perf_counter() - started)
            assert response.status == 200, f"{mode}: {response.status}"
        after = cpu_seconds(proc.pid), cpu_seconds(envoy.pid)
    finally:
        for p in (proc, envoy):
            p.kill()
            p.wait()
    return {"processor_cpu_ms": 1000 * (after[0] - before[0]) / calls, "envoy_cpu_ms": 1000 * (after[1] - before[1]) / calls,
            "latencies": latencies}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000, help="calls a round (1000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each, alternating (2)")
    parser.add_argument("--serve", nargs=2, metavar=("MODE", "SOCKET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(*args.serve))
        return 0
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="gaas-extproc-") as tmp:
        for r in range(args.rounds):
            for mode in MODES:
                say(f"round {r + 1}: {args.calls} calls through {mode}")
                runs[mode].append(measure(mode, args.calls, Path(tmp)))
    results = {}
    print(f"\n{'the router reached over':<26}{'router CPU/call':>17}{'Envoy CPU/call':>16}{'round trip p50':>16}"
          f"{'p99':>10}")
    for mode, rs in runs.items():
        lat = sorted(x for r in rs for x in r["latencies"])
        results[mode] = {
            "processor_cpu_ms": round(sum(r["processor_cpu_ms"] for r in rs) / len(rs), 3),
            "envoy_cpu_ms": round(sum(r["envoy_cpu_ms"] for r in rs) / len(rs), 3),
            "p50_ms": round(1000 * percentile(lat, 0.5), 3), "p99_ms": round(1000 * percentile(lat, 0.99), 3),
            "calls": len(lat),
        }
        x = results[mode]
        print(f"{mode:<26}{x['processor_cpu_ms']:>14.3f} ms{x['envoy_cpu_ms']:>13.3f} ms{x['p50_ms']:>13.3f} ms"
              f"{x['p99_ms']:>7.3f} ms")
    g, h = results["grpc.aio"], results["http/1.1"]
    print(f"\nHTTP/1.1 saves {g['processor_cpu_ms'] - h['processor_cpu_ms']:.3f} ms of the router's CPU a call "
          f"({g['processor_cpu_ms'] / max(h['processor_cpu_ms'], 1e-9):.1f}x) and "
          f"{g['p50_ms'] - h['p50_ms']:.3f} ms of the round trip at p50")
    out = write_json(RESULTS / "extproc_call.json", {"calls_per_round": args.calls, "rounds": args.rounds,
                                                     "results": results})
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
