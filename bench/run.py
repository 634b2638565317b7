"""make bench: GaaS's serving figures beside vLLM's own OpenAI server, measured with vLLM's own load
tester, `vllm bench serve` (the tool people point at vLLM-compatible endpoints).

Starts, side by side on free ports:
  - the GaaS mesh (`gaas up`'s machinery: Redis, services, Envoys) with one worker pinned to a core,
    once for each ingress path (--paths): "gaas ingress" streams through the router, "gaas
    ingress, direct" from the worker the router picked at the ingress straight to the ingress;
  - vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server) on the same model, its
    model runner pinned to the same core, with the same cache size, block size and eager mode, and
    its engine processes placed as gaas places a worker's (scheduler beside the runner, API server
    on the other cores) so the comparison is of the architecture, not of placement: once with
    vLLM's own executor on the CPU (the model runner a process of its own: "gaas's placement"),
    once with the worker's (the model in the engine core's process: "gaas's engine"), which is what
    the mesh's own cost is judged against. --with-stock adds the server as it comes.
Then, for each target and for the `openai` (/v1/completions) and `openai-chat` backends, runs
`vllm bench serve` on the random dataset (greedy, ignore_eos): one request at a time, in rounds
that alternate between the targets so drift hits all alike, then --concurrency streams at once.
GaaS's native gRPC API is measured with the gaas client in the same way (vllm bench speaks HTTP
only). Prints a table and writes bench/results/serving.json; every run must have zero failures.

TTFT: request sent -> first streamed token. TPOT: time per output token after the first. ITL:
gaps between streamed chunks.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common.output import RESULTS, closing, progress, write_json
from bench.common.stats import percentile
from bench.common.vllm import free_port, merge_detailed, start_vllm_server, stop_group, wait_http

say = progress("bench")


def prompts(n: int) -> list[str]:
    topics = ["the sea", "a lighthouse", "winter", "an old map", "the last train", "a clockmaker", "rain", "a garden"]
    return [f"Request {i}: tell me a short story about {topics[i % len(topics)]}." for i in range(n)]


# ------------------------------------------------------------------ clients


def grpc_stream(client, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int, dict]:
    """(TTFT s, gaps between token chunks s, tokens, the mesh's latency decomposition in ms)."""
    from gaas.contracts import latency

    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    parts: dict = {}
    for chunk in client.generate(prompt, model=model, max_tokens=max_tokens, temperature=0):
        if chunk.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(chunk.token_ids)
        if chunk.timings.total_ms:
            parts = latency.as_dict(chunk.timings)
    if not stamps:
        return float("nan"), [], 0, parts
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], tokens, parts


class Series:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.latency: list[dict] = []

    def add(self, result: tuple[float, list[float], int, dict]) -> None:
        ttft, gaps, tokens, parts = result
        self.ttft.append(ttft)
        self.itl.extend(gaps)
        self.tokens += tokens
        if parts:
            self.latency.append(parts)

    def summary(self) -> dict:
        ms = lambda v: round(v * 1000, 2)  # noqa: E731
        return {
            "requests": len(self.ttft),
            "tokens": self.tokens,
            "ttft_p50_ms": ms(percentile(self.ttft, 0.5)),
            "ttft_p99_ms": ms(percentile(self.ttft, 0.99)),
            "ttft_mean_ms": ms(statistics.fmean(self.ttft)) if self.ttft else None,
            "itl_p50_ms": ms(percentile(self.itl, 0.5)),
            "itl_p99_ms": ms(percentile(self.itl, 0.99)),
            # The mesh's own account of each request (gaas.contracts.latency), p50 / p99 per part.
            "latency_ms": {
                part: {"p50": round(percentile([d[part] for d in self.latency], 0.5), 3),
                       "p99": round(percentile([d[part] for d in self.latency], 0.99), 3)}
                for part in (self.latency[0] if self.latency else {})
            },
        }


def concurrent_throughput(fn, n_requests: int, concurrency: int, max_tokens: int) -> dict:
    ps = prompts(n_requests)
    tokens = 0
    lock = threading.Lock()

    def one(p: str) -> None:
        nonlocal tokens
        _, _, t, _ = fn(p)
        with lock:
            tokens += t

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, ps))
    elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": n_requests, "tokens": tokens, "seconds": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1)}


def settle() -> None:
    """Let the engine last used go quiet before measuring another: vLLM's engine processes
    busy-wait for a second after their last step, and both engines share a core here."""
    time.sleep(1.5)


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=80, help="one-at-a-time requests per target and backend (80)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds they are split into, alternating targets (4)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset, 128)")
    ap.add_argument("--output-len", type=int, default=32, help="tokens generated per request (32)")
    ap.add_argument("--concurrency", type=int, default=8, help="streams at once in the throughput run (8; 0 skips it)")
    ap.add_argument("--skip-vllm", action="store_true", help="measure GaaS only")
    ap.add_argument("--with-stock", action="store_true", help="also measure vLLM's server as it comes (no pinning)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens per streamed message, for the workers and vLLM's server alike (1)")
    ap.add_argument("--paths", default="router,direct",
                    help="the meshes measured, by the ingress's path to the workers: router (through the router), "
                    "direct (straight to the worker the router picked at the ingress); comma-separated (both)")
    ap.add_argument("--out", default=str(RESULTS / "serving.json"))
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    if not paths or set(paths) - set(MESH_TARGETS):
        ap.error(f"--paths: one or more of {', '.join(MESH_TARGETS)}")

    from bench import footprint
    from bench.vllm_bench import run as vllm_bench
    from bench.common.mesh import bench_mesh, demo_key
    from gaas.sdk.client import GaasClient
    from gaas.host.placement import pin_descendants, worker_cpus

    # One mesh per path, side by side (each its own run directory, ports and Redis); their workers
    # share the core, as they take turns being measured.
    meshes = {MESH_TARGETS[path]: bench_mesh(f"bench-{path}", 22000 + 200 * i, say, ingress_path=path,
                                             worker_options={"stream_interval": args.stream_interval})
              for i, path in enumerate(paths)}
    mesh = next(iter(meshes.values()))  # the native gRPC API's (the same on both paths)
    topo, run_dir = mesh.topo, mesh.run_dir
    model = mesh.spec.served[0]  # the deployment's served model (gaas-tiny by default)
    core, others = worker_cpus(0, 1)  # where gaas places worker-0's engine, and the rest
    vllm_procs: list[subprocess.Popen] = []
    # Each target's processes whose CPU is its front end's cost (name -> pid), and those of them
    # whose descendants are its engine (not counted: the engine is the same on both sides).
    processes: dict[str, dict[str, int]] = {}
    engines: dict[str, set[str]] = {}
    # Each target's background CPU (footprint.idle_rates), measured once before its first run.
    idle: dict[str, dict[str, tuple[float, float]]] = {}
    results: dict = {"serving": {}, "grpc": {}, "cpu": {}, "cost": {}, "memory": {}, "host": {}}
    targets = {}
    try:
        for name, m in meshes.items():
            say(f"starting the GaaS mesh for {name!r} (logs in {m.run_dir / 'logs'})")
            m.start()
            m.wait_ready(300)
            os.environ["GAAS_HOME"] = str(m.run_dir)  # the operator of this mesh, for its admin calls
            targets[name] = (f"http://{m.topo.ingress}", demo_key(m))
            processes[name] = {c.name: c.proc.pid for c in m.children}
            engines[name] = {c.name for c in m.children if c.name.startswith("worker-")}
        key = targets[next(iter(meshes))][1]
        os.environ["GAAS_HOME"] = str(run_dir)
        if not args.skip_vllm:
            for variant in ("engine", "pinned", "stock") if args.with_stock else ("engine", "pinned"):
                port = free_port()
                log = run_dir / "logs" / f"vllm-openai-server-{variant}.log"
                say(f"starting vLLM's OpenAI server ({variant}) on 127.0.0.1:{port}, model runner on core {core} "
                    f"(log {log})")
                executor = str(topo.worker_defaults["executor"]) if variant == "engine" else "mp"
                proc = start_vllm_server(Path(model.source), model.name, port, core, log,
                                         ["--stream-interval", str(args.stream_interval)], executor=executor)
                vllm_procs.append(proc)
                wait_http(f"http://127.0.0.1:{port}/health", proc, 300, log)
                if variant != "stock":
                    # The placement gaas gives its workers: engine processes beside the runner,
                    # the API server on the other cores.
                    pin_descendants(proc.pid, {core})
                    if others:
                        os.sched_setaffinity(proc.pid, others)
                name = VLLM_TARGETS[variant]
                targets[name] = (f"http://127.0.0.1:{port}", None)
                processes[name] = {"api server": proc.pid}
                engines[name] = {"api server"}

        def bench(target: str, backend: str, prompts_n: int, concurrency: int) -> dict:
            url, api_key = targets[target]
            settle()
            return vllm_bench(url, model.name, model.source, backend=backend, api_key=api_key, num_prompts=prompts_n,
                              input_len=args.input_len, output_len=args.output_len, max_concurrency=concurrency,
                              extra=["--save-detailed"])

        say("warming up")
        for target in targets:
            bench(target, "openai", 4, 1)
        per_round = max(1, args.requests // args.rounds)
        for backend in ("openai", "openai-chat"):
            runs: dict[str, list[dict]] = {t: [] for t in targets}
            for r in range(args.rounds):
                for target in targets:
                    say(f"vllm bench serve --backend {backend}: round {r + 1}/{args.rounds}, {per_round} requests one "
                        f"at a time on {target}")
                    runs[target].append(bench(target, backend, per_round, 1))
            for target, rs in runs.items():
                results["serving"][f"{target} | {backend} | 1"] = merge_detailed(rs)
            if args.concurrency > 0:
                for target in targets:
                    say(f"vllm bench serve --backend {backend}: {args.concurrency} streams at once on {target}")
                    measured = meshes.get(target) if backend == "openai" else None
                    if measured:
                        cpu_before = {c.name: footprint.cpu_seconds(c.proc.pid) for c in measured.children}
                    if target not in idle:
                        settle()
                        idle[target] = footprint.idle_rates(processes[target])
                    parts_before = {n: footprint.cpu_parts(pid) for n, pid in processes[target].items()}
                    host = footprint.host_times()
                    started = time.perf_counter()
                    r = bench(target, backend, args.concurrency * 8, args.concurrency)
                    wall = time.perf_counter() - started
                    ok = [n for n, err in zip(r["output_lens"], r["errors"]) if not err]
                    results["cost"][f"{target} | {backend} | {args.concurrency}"] = footprint.front_cost(
                        parts_before, {n: footprint.cpu_parts(pid) for n, pid in processes[target].items()},
                        engines[target], sum(ok), len(ok), idle[target], wall)
                    results["serving"][f"{target} | {backend} | {args.concurrency}"] = merge_detailed([r])
                    results["host"][f"{target} | {backend} | {args.concurrency}"] = footprint.host_load(
                        host, footprint.host_times())
                    if measured:
                        # CPU each mesh process spent on the run, per token it carried.
                        tokens = sum(n for n, err in zip(r["output_lens"], r["errors"]) if not err)
                        results["cpu"][target] = {"output_tokens": tokens, "seconds": {
                            c.name: round(footprint.cpu_seconds(c.proc.pid) - cpu_before[c.name], 3)
                            for c in measured.children}}

        say("gaas native gRPC API, gaas client")
        gaas_grpc = GaasClient(topo.ingress, api_key=key)
        fn = lambda p: grpc_stream(gaas_grpc, model.name, p, args.output_len)  # noqa: E731
        for p in prompts(5):
            fn(p)
        series = Series("gaas gRPC")
        for p in prompts(args.requests):
            series.add(fn(p))
        results["grpc"]["sequential"] = series.summary()
        if args.concurrency > 0:
            settle()
            results["grpc"]["concurrent"] = concurrent_throughput(fn, args.concurrency * 8, args.concurrency,
                                                                  args.output_len)
        gaas_grpc.close()
        # What each mesh process holds after the load (its whole process tree: a worker's engine).
        for name, m in meshes.items():
            results["memory"][name] = {c.name: footprint.memory(c.proc.pid) for c in m.children}
    finally:
        for proc in vllm_procs:
            stop_group(proc)
        for name, m in meshes.items():
            say(f"stopping the mesh for {name!r}")
            m.stop()

    results["setup"] = {
        "model": model.name, "model_dir": model.source, "input_len": args.input_len, "output_len": args.output_len,
        "worker_core": core, "cpus": os.cpu_count(), "machine": platform.machine(),
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "tool": "vllm bench serve",
        "stream_interval": args.stream_interval, "paths": paths,
    }
    out = write_json(args.out, results)

    print(f"\nvllm bench serve, random dataset, {model.name}, {args.input_len} prompt + {args.output_len} output tokens, "
          f"greedy (worker and vLLM server pinned to core {core}; {args.stream_interval} token(s) per streamed message)\n")
    head = f"{'target':<32} {'backend':<12} {'conc':>4} {'ok':>4} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} " \
           f"{'TPOT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>7}"
    print(head + "   (ms)")
    for name, s in results["serving"].items():
        target, backend, conc = name.split(" | ")
        print(f"{target:<32} {backend:<12} {conc:>4} {s['completed']:>4} {s['failed']:>4} {s['ttft_p50_ms']:>9} "
              f"{s['ttft_p99_ms']:>9} {s['tpot_p50_ms']:>9} {s['itl_p50_ms']:>8} {s['itl_p99_ms']:>8} "
              f"{s['output_tokens_per_s']:>7}")
    g = results["grpc"]["sequential"]
    line = f"{'gaas gRPC (gaas client)':<32} {'native':<12} {1:>4} {g['requests']:>4} {0:>4} {g['ttft_p50_ms']:>9} " \
           f"{g['ttft_p99_ms']:>9} {'':>9} {g['itl_p50_ms']:>8} {g['itl_p99_ms']:>8}"
    print(line)
    if "concurrent" in results["grpc"]:
        c = results["grpc"]["concurrent"]
        print(f"{'gaas gRPC (gaas client)':<32} {'native':<12} {c['concurrency']:>4} {c['requests']:>4} {0:>4} "
              f"{'':>9} {'':>9} {'':>9} {'':>8} {'':>8} {c['tokens_per_s']:>7}")
    if g.get("latency_ms"):
        print("\nwhere the time went, gRPC one at a time (the mesh's own account, ms):  "
              + "  ".join(f"{part} {v['p50']:g} / {v['p99']:g}" for part, v in g["latency_ms"].items())
              + "   (p50 / p99)")
    goals = overhead_goals(results, args.concurrency)
    results["goals"] = goals
    write_json(out, results)
    for target, memory in results["memory"].items():
        print(f"\nmemory after the load, {target}, each process tree (MB): "
              + "  ".join(f"{name} {m['pss_mb']:g} PSS / {m['rss_mb']:g} RSS" for name, m in memory.items()))
    steal = [h["mean_steal_pct"] for h in results["host"].values()]
    if steal:
        print(f"\nthe hypervisor's steal during the {args.concurrency}-stream runs: {min(steal):g}-{max(steal):g}% of "
              "the cores' time (figures taken under much of it are slower than the same cores alone give)")
    if results["cost"]:
        print(f"\nCPU of each server's own processes during the {args.concurrency}-stream runs: the engine apart "
              f"(a worker's and vLLM's engine core), and the background apart (what the processes spend with no "
              f"request, measured for {footprint.IDLE_SECONDS:g} s before: idle, % of one core):")
        print(f"{'target':<32} {'backend':<12} {'us/token':>9} {'us/request':>11} {'engine s':>9} {'idle %':>7}  where")
        for name, c in results["cost"].items():
            target, backend, _ = name.split(" | ")
            where = "  ".join(f"{n} {v:g}" for n, v in list(c["seconds"].items())[:6] if v > 0)
            print(f"{target:<32} {backend:<12} {c['us_per_token'] or 0:>9} {c['us_per_request'] or 0:>11} "
                  f"{c['engine_cpu_s']:>9} {c['idle_core_pct']:>7}  {where}")
    for target, c in results["cpu"].items():
        busy = sorted(c["seconds"].items(), key=lambda kv: -kv[1])
        print(f"CPU seconds, {target}, during the {args.concurrency}-stream /v1/completions run "
              f"({c['output_tokens']} tokens): " + "  ".join(f"{n} {v:g}" for n, v in busy if v > 0))
    if goals:
        print("\nthe mesh's own cost against issue 11's goals:")
        for g in goals:
            print(f"  {g['what']:<80} {g['shown']:>12}  goal {g['goal']:<10} {'met' if g['met'] else 'NOT MET'}")
    return closing(out, results["serving"].values())


# The mesh as each ingress path runs it (the topology's ingress.path).
MESH_TARGETS = {"router": "gaas ingress", "direct": "gaas ingress, direct"}
# vLLM's server as each variant runs it: with GaaS's placement and GaaS's engine (the reference
# for the mesh's own cost), with GaaS's placement and vLLM's own executor, as it comes.
VLLM_TARGETS = {
    "engine": "vllm server, gaas's engine",
    "pinned": "vllm server, gaas's placement",
    "stock": "vllm server, as it comes",
}
WORKER_MEMORY_GOAL_MB = 2300
SERVICE_MEMORY_GOAL_MB = 150
ROUTER_TOKENS_PER_CORE_GOAL = 50_000
# The mesh's own processes (Envoys, router, the worker's front end, the services; engine apart)
# against vLLM's API server process with the same engine (issue 28).
CPU_PER_TOKEN_RATIO_GOAL = 1.25
CPU_PER_REQUEST_EXTRA_GOAL_US = 2000


def overhead_goals(results: dict, concurrency: int) -> list[dict]:
    """Each figure the mesh's own cost is judged by (issue 11), for each mesh measured (each
    ingress path), measured against vLLM's server with the same placement on /v1/completions --
    with the same engine as the worker's (the mesh's own cost), and with vLLM's own executor
    (what a user would otherwise run): the TTFT the mesh adds at p50, the TTFT tail's ratio, the
    throughput ratio with concurrent streams; the tokens served per CPU-second of the router; the
    memory of the worker (its engine included) and of each other service (PSS)."""
    s = results["serving"]
    goals = []

    def goal(what, measured, shown, goal, met):
        goals.append({"what": what, "measured": measured, "shown": shown, "goal": goal, "met": bool(met)})

    for target in MESH_TARGETS.values():
        gaas1, gaasn = s.get(f"{target} | openai | 1"), s.get(f"{target} | openai | {concurrency}")
        for variant, server in (("engine", "the same engine"), ("pinned", "vLLM's executor")):
            vllm1 = s.get(f"{VLLM_TARGETS[variant]} | openai | 1")
            vllmn = s.get(f"{VLLM_TARGETS[variant]} | openai | {concurrency}")
            if gaas1 and vllm1:
                added = round(gaas1["ttft_p50_ms"] - vllm1["ttft_p50_ms"], 2)
                goal(f"{target}: TTFT the mesh adds, p50, vs vLLM server ({server})", added, f"{added:+.2f} ms",
                     "<= 3 ms", added <= 3)
                ratio = round(gaas1["ttft_p99_ms"] / vllm1["ttft_p99_ms"], 2)
                goal(f"{target}: TTFT p99, mesh / vLLM server ({server})", ratio, f"{ratio:.2f}x", "<= 1.5x",
                     ratio <= 1.5)
            if gaasn and vllmn and vllmn["output_tokens_per_s"]:
                ratio = round(gaasn["output_tokens_per_s"] / vllmn["output_tokens_per_s"], 3)
                goal(f"{target}: tokens/s, {concurrency} streams, mesh / vLLM server ({server})", ratio,
                     f"{ratio:.2f}x", ">= 0.95x", ratio >= 0.95)
        for backend in ("openai", "openai-chat"):
            mine = results.get("cost", {}).get(f"{target} | {backend} | {concurrency}")
            vllm = results.get("cost", {}).get(f"{VLLM_TARGETS['engine']} | {backend} | {concurrency}")
            if mine and vllm and mine["us_per_token"] and vllm["us_per_token"]:
                ratio = round(mine["us_per_token"] / vllm["us_per_token"], 2)
                goal(f"{target}: {backend} CPU per output token, mesh / vLLM API server (engines apart)", ratio,
                     f"{ratio:.2f}x", f"<= {CPU_PER_TOKEN_RATIO_GOAL}x", ratio <= CPU_PER_TOKEN_RATIO_GOAL)
                extra = mine["us_per_request"] - vllm["us_per_request"]
                goal(f"{target}: {backend} CPU per request, mesh - vLLM API server", extra, f"{extra / 1000:+.2f} ms",
                     "<= +2 ms", extra <= CPU_PER_REQUEST_EXTRA_GOAL_US)
        cpu = results.get("cpu", {}).get(target)
        if cpu and cpu["seconds"].get("router-0"):
            rate = round(cpu["output_tokens"] / cpu["seconds"]["router-0"])
            goal(f"{target}: tokens served per CPU-second of the router", rate, f"{rate:,}", ">= 50,000",
                 rate >= ROUTER_TOKENS_PER_CORE_GOAL)
        for name, m in results.get("memory", {}).get(target, {}).items():
            if name.startswith("worker-"):
                goal(f"{target}: {name} memory, engine included (PSS)", m["pss_mb"], f"{m['pss_mb']:,.0f} MB",
                     "<= 2300 MB", m["pss_mb"] <= WORKER_MEMORY_GOAL_MB)
            elif name.split("-")[0] in ("router", "control", "kvcache", "billing"):
                goal(f"{target}: {name} memory (PSS)", m["pss_mb"], f"{m['pss_mb']:,.0f} MB", "<= 150 MB",
                     m["pss_mb"] <= SERVICE_MEMORY_GOAL_MB)
    return goals

if __name__ == "__main__":
    sys.exit(main())
