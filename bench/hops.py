"""Which hop the mesh's time is spent in: the same generation sent in at each hop of the path a
request takes, from the worker's own socket outwards, so each hop's cost is the difference between
two rows.

    worker            the worker's gRPC service on its Unix socket: GaaS's engine and front end alone
    worker sidecar    + the worker's Envoy (mutual TLS), called as the router is
    router            the router's gRPC service on its Unix socket (its own work: admission in Redis,
                      picking, metering, and its call out through its own sidecar)
    router sidecar    + the router's Envoy (mutual TLS), called as the ingress is
    ingress           + the ingress Envoy: the whole mesh, as the native gRPC API is used

Starts the mesh with one worker (its engine pinned to a core, as `make bench` does). Each request:
128 prompt token ids, 32 tokens generated (greedy, ignore_eos) and streamed. Per entry point: TTFT
one request at a time (rounds alternating between the entry points, so drift hits all alike),
then output tokens/s with --concurrency streams at once. Prints a table and writes
bench/results/hops.json.

    python -m bench.hops [--requests 60] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

from bench.common.output import RESULTS, progress, write_json
from bench.common.stats import percentile

ENTRIES = ("worker", "worker sidecar", "router", "router sidecar", "ingress")

say = progress("hops")


def entry_points(topo, run_dir: Path, api_key: str, model: str) -> dict:
    """name -> call(request_number) -> a stream of chunks, for each entry point of ENTRIES."""
    import grpc

    from gaas.ops import pki, topology
    from gaas.v1 import inference_pb2_grpc, worker_pb2, worker_pb2_grpc

    worker, router = topo.of("worker")[0], topo.of("router")[0]
    sockets = topology.sockets_root(run_dir)
    authority = pki.Authority(run_dir)

    def socket(inst) -> str:
        return f"unix:{sockets / inst.name / 'service.sock'}"

    # Each hop called by the identity the mesh's own caller of it has (its sidecar checks it).
    worker_stubs = {
        "worker": worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(socket(worker))),
        "worker sidecar": worker_pb2_grpc.WorkerStub(pki.channel(
            f"{topo.host}:{worker.inbound_port}", authority.credentials("router", router.name), aio=True)),
    }
    public_stubs = {
        "router": inference_pb2_grpc.InferenceStub(grpc.aio.insecure_channel(socket(router))),
        "router sidecar": inference_pb2_grpc.InferenceStub(pki.channel(
            f"{topo.host}:{router.inbound_port}", authority.credentials("ingress", "ingress-0"), aio=True)),
        "ingress": inference_pb2_grpc.InferenceStub(grpc.aio.insecure_channel(topo.ingress)),
    }
    rng = random.Random(0)
    auth = (("authorization", f"Bearer {api_key}"),)

    def request(n: int):
        from gaas.v1 import common_pb2, inference_pb2

        ids = [rng.randrange(10, 2000) for _ in range(128)]
        return inference_pb2.GenerateRequest(model=model, prompt_token_ids=ids, max_tokens=32,
                                             sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True))

    def to_worker(stub):
        def call(n: int):
            # As the router sends it: an id of GaaS's, the tenant, its cache salt.
            r = worker_pb2.WorkerGenerateRequest(request=request(n), request_id=f"hops-{os.getpid()}-{n}",
                                                 cache_salt="hops")
            return stub.Generate(r, metadata=(("x-gaas-tenant", "demo"),))
        return call

    def to_router(stub):
        return lambda n: stub.Generate(request(n), metadata=auth)

    calls = {name: to_worker(stub) for name, stub in worker_stubs.items()}
    calls.update({name: to_router(stub) for name, stub in public_stubs.items()})
    return {name: calls[name] for name in ENTRIES}


async def one(call, n: int) -> tuple[float, int]:
    """(TTFT ms, tokens) of one streamed generation."""
    started = time.perf_counter()
    first, tokens = None, 0
    async for chunk in call(n):
        if chunk.token_ids:
            if first is None:
                first = (time.perf_counter() - started) * 1000
            tokens += len(chunk.token_ids)
    return first or float("nan"), tokens


async def measure(make_calls, requests: int, rounds: int, concurrency: int, per_stream: int) -> dict:
    calls = make_calls()  # grpc.aio channels belong to the loop they are made in
    n = 0

    def next_n() -> int:
        nonlocal n
        n += 1
        return n

    for call in calls.values():  # warm every channel and path
        for _ in range(3):
            await one(call, next_n())
    ttfts: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name, call in calls.items():
            for _ in range(max(1, requests // rounds)):
                ttfts[name].append((await one(call, next_n()))[0])
    out = {}
    for name, call in calls.items():
        tokens = 0

        async def stream() -> None:
            nonlocal tokens
            for _ in range(per_stream):
                got = (await one(call, next_n()))[1]
                tokens += got

        started = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        rate = tokens / (time.perf_counter() - started)
        out[name] = {"ttft_p50_ms": round(percentile(ttfts[name], 0.5), 2),
                     "ttft_p90_ms": round(percentile(ttfts[name], 0.9), 2),
                     "requests": len(ttfts[name]), "tokens_per_s": round(rate, 1)}
        say(f"{name}: TTFT p50 {out[name]['ttft_p50_ms']} ms, {concurrency} streams {rate:.0f} tokens/s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60, help="one-at-a-time requests per entry point (60)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds they are split into (4)")
    ap.add_argument("--concurrency", type=int, default=8, help="streams at once in the throughput run (8)")
    ap.add_argument("--per-stream", type=int, default=10, help="requests per stream in that run (10)")
    ap.add_argument("--out", default=str(RESULTS / "hops.json"))
    args = ap.parse_args(argv)

    from bench.common.mesh import bench_mesh, demo_key, running

    mesh = bench_mesh("hops", 23000, say)
    run_dir = mesh.run_dir
    model = mesh.spec.served[0].name
    say(f"starting the mesh (logs in {run_dir / 'logs'})")
    with running(mesh, 300, keep=True):
        key = demo_key(mesh)
        topo = mesh.topo  # (its workers: the deployment's, started by now)
        results = asyncio.run(measure(lambda: entry_points(topo, run_dir, key, model), args.requests, args.rounds,
                                      args.concurrency, args.per_stream))

    print(f"\nthe same generation ({model}, 128 prompt token ids + 32 tokens, streamed) sent in at each hop; "
          f"each row adds the hop named to the row above\n")
    print(f"{'entry point':<16} {'TTFT p50':>9} {'+ hop':>7} {'TTFT p90':>9} {f'{args.concurrency} streams tok/s':>20} "
          f"{'of the worker':>14}")
    prev = None
    first = results[ENTRIES[0]]["tokens_per_s"]
    for name in ENTRIES:
        r = results[name]
        added = "" if prev is None else f"{r['ttft_p50_ms'] - prev:+.2f}"
        print(f"{name:<16} {r['ttft_p50_ms']:>9} {added:>7} {r['ttft_p90_ms']:>9} {r['tokens_per_s']:>20} "
              f"{r['tokens_per_s'] / first:>13.2f}x")
        prev = r["ttft_p50_ms"]
    out = write_json(args.out, {"model": model, "prompt_tokens": 128, "output_tokens": 32,
                                "concurrency": args.concurrency, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "entry_points": results})
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
