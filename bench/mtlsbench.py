"""What mutual TLS costs per hop between sidecars.

One hop exactly as the mesh builds it (gaas/envoy/config.py): a caller's sidecar outbound listener (a
Unix socket) -> the callee's sidecar inbound listener (TCP) -> the service (a Unix socket), with
Envoy 1 thread each. Measured twice: the inbound listener and the cluster with the mesh's mutual
TLS, RBAC and caller forwarding (as `gaas up` renders them), and the same hop in plaintext. The
service is a gRPC server answering unary calls and streaming 16 small messages; the figure is the
difference in p50 latency (unary round trip, and time to the first streamed message, as a TTFT is).

Goal (issue 10): < 0.2 ms p50 per hop. Prints a table and writes bench/results/mtls.json.

    python -m bench.mtlsbench [--calls 3000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gaas.envoy import config as envoyconf
from gaas.envoy.bootstrap import bootstrap
from gaas.envoy.clusters import static_cluster
from gaas.envoy.listeners import hcm, listener, pipe_address
from gaas.envoy.routes import grpc_route
from gaas.envoy.tls import client_tls, server_tls
from gaas.ops import pki
from gaas.launcher.rundir import free_port_base
from bench.common.output import RESULTS, progress, write_json
from bench.common.stats import percentile

GOAL_MS = 0.2


say = progress("mtls")


_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()


def _service() -> grpc.GenericRpcHandler:
    """The health service's two methods (which RBAC lets every identity of the mesh call): Check
    answers at once; Watch streams 16 answers at once, a stand-in for tokens."""

    def watch(request, context):
        for _ in range(16):
            yield _SERVING

    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(lambda request, context: _SERVING),
        "Watch": grpc.unary_stream_rpc_method_handler(watch),
    })


def _configs(tmp: Path, port: int, tls: bool) -> tuple[dict, dict]:
    authority = pki.Authority(tmp)
    caller = authority.credentials("router", "router-0")
    callee = authority.credentials("worker", "worker-0")
    if tls:  # the worker sidecar's inbound as the mesh renders it
        inbound_hcm = envoyconf.inbound_hcm("inbound", "worker", tmp / "access.log")
    else:
        inbound_hcm = hcm(
            "inbound", [{"match": {"prefix": "/"}, "route": {"cluster": "local_service", "timeout": "0s"}}], [],
            tmp / "access.log")
    service = envoyconf.pipe_cluster("local_service", tmp / "service.sock")
    callee_cfg = bootstrap(
        "sidecar-callee", pipe_address(tmp / "callee-admin.sock"),
        [listener("inbound", "127.0.0.1", port, inbound_hcm, server_tls(callee) if tls else None)],
        [service],
    )
    outbound_hcm = hcm("outbound", [grpc_route("/", "peer")], [], tmp / "access.log")
    peer = static_cluster("peer", [("127.0.0.1", port)], health_check=False,
                          tls=client_tls(caller, "worker") if tls else None)
    caller_cfg = bootstrap(
        "sidecar-caller", pipe_address(tmp / "caller-admin.sock"),
        [listener("outbound", "", 0, outbound_hcm, pipe=tmp / "outbound.sock")], [peer],
    )
    return caller_cfg, callee_cfg


def _start_envoys(tmp: Path, configs: tuple[dict, dict]) -> list[subprocess.Popen]:
    procs = []
    for name, cfg in zip(("caller", "callee"), configs):
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        procs.append(subprocess.Popen(
            [envoyconf.envoy_binary(), "-c", str(path), "--concurrency", "1", "--disable-hot-restart",
             "--log-level", "error"], stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "w")))
    return procs


def _measure(target: str, calls: int) -> dict:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 20
        while True:
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for _ in range(200):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        unary, first = [], []
        for _ in range(calls):
            t = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            unary.append((time.perf_counter() - t) * 1000)
        for _ in range(calls // 4):
            t = time.perf_counter()
            stream = stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)
            next(stream)
            first.append((time.perf_counter() - t) * 1000)
            for _ in stream:
                pass
    return {"unary_p50_ms": percentile(unary, 0.5), "unary_p99_ms": percentile(unary, 0.99),
            "first_message_p50_ms": percentile(first, 0.5), "first_message_p99_ms": percentile(first, 0.99)}


def run(calls: int) -> dict:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    results = {}
    with tempfile.TemporaryDirectory(prefix="gaas-mtls-") as d:
        tmp = Path(d)
        authority = pki.Authority(tmp)
        authority.ensure()
        authority.issue("router", "router-0")
        authority.issue("worker", "worker-0", sidecar="127.0.0.1:1")
        server.add_generic_rpc_handlers((_service(),))
        server.add_insecure_port(f"unix:{tmp / 'service.sock'}")
        server.start()
        try:
            for mode in ("plaintext", "mtls", "plaintext ", "mtls "):  # twice each, interleaved
                port = free_port_base(span=2, start=27000)
                procs = _start_envoys(tmp, _configs(tmp, port, mode.strip() == "mtls"))
                try:
                    say(f"{mode.strip()}: {calls} unary calls and {calls // 4} streams through one hop")
                    figures = _measure(f"unix:{tmp / 'outbound.sock'}", calls)
                finally:
                    for p in procs:
                        p.terminate()
                        p.wait(timeout=10)
                    for s in ("outbound.sock", "caller-admin.sock", "callee-admin.sock"):
                        (tmp / s).unlink(missing_ok=True)
                key = mode.strip()
                prev = results.get(key)
                results[key] = figures if prev is None else {k: min(prev[k], v) for k, v in figures.items()}
        finally:
            server.stop(None)
    cost = {k: results["mtls"][k] - results["plaintext"][k] for k in results["mtls"]}
    return {"calls": calls, "per_hop": results, "mtls_cost_ms": cost, "goal_ms": GOAL_MS,
            "goal_met": cost["unary_p50_ms"] < GOAL_MS and cost["first_message_p50_ms"] < GOAL_MS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000, help="unary calls per mode (a quarter as many streams)")
    p.add_argument("--out", default=str(RESULTS / "mtls.json"))
    args = p.parse_args()
    r = run(args.calls)
    print(f"\nOne sidecar-to-sidecar hop ({args.calls} calls, best of two runs per mode)")
    print(f"{'':<12} {'unary p50':>10} {'unary p99':>10} {'1st msg p50':>12} {'1st msg p99':>12}")
    for mode, f in r["per_hop"].items():
        print(f"{mode:<12} {f['unary_p50_ms']:>9.3f}ms {f['unary_p99_ms']:>9.3f}ms "
              f"{f['first_message_p50_ms']:>11.3f}ms {f['first_message_p99_ms']:>11.3f}ms")
    c = r["mtls_cost_ms"]
    print(f"{'mTLS cost':<12} {c['unary_p50_ms']:>9.3f}ms {c['unary_p99_ms']:>9.3f}ms "
          f"{c['first_message_p50_ms']:>11.3f}ms {c['first_message_p99_ms']:>11.3f}ms")
    print(f"goal: < {GOAL_MS} ms p50 per hop: {'met' if r['goal_met'] else 'NOT met'}")
    write_json(args.out, r)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    main()
