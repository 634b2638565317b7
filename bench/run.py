"""make bench: streamed latency through GaaS's ingress against vLLM's own OpenAI server.

Starts, side by side on free ports:
  - the GaaS mesh (`gaas up`'s machinery: Redis, services, Envoys) with one worker pinned to a core;
  - vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server) on the same model, its
    model runner pinned to the same core, with the same cache size, block size and eager mode:
    once as it comes, once with its engine processes placed as gaas places a worker's (scheduler
    beside the runner, API server on the other cores), to tell placement from architecture.
Then sends the same prompts, one at a time, with the official `openai` client (streaming
completions), alternating between the two in rounds so drift hits both alike; also through
GaaS's native gRPC API. Then a concurrent run for aggregate throughput. Prints a table and writes
JSON (bench/results/openai_latency.json).

TTFT: request sent -> first streamed token. ITL: gaps between streamed tokens (chunks). Requests
decode greedily, so both servers generate the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def prompts(n: int) -> list[str]:
    topics = ["the sea", "a lighthouse", "winter", "an old map", "the last train", "a clockmaker", "rain", "a garden"]
    return [f"Request {i}: tell me a short story about {topics[i % len(topics)]}." for i in range(n)]


# ------------------------------------------------------------------ clients


def openai_stream(client, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(ttft_s, gaps between streamed chunks in s, tokens) of one streamed completion."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        # A chunk per engine step on both servers (its text may be empty while a multi-byte
        # character is being completed; under load one chunk may carry several tokens).
        if chunk.choices:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    if not stamps:
        return float("nan"), [], 0
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], tokens


def grpc_stream(client, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    for chunk in client.generate(prompt, model=model, max_tokens=max_tokens, temperature=0):
        if chunk.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(chunk.token_ids)
    if not stamps:
        return float("nan"), [], 0
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], tokens


class Series:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0

    def add(self, result: tuple[float, list[float], int]) -> None:
        ttft, gaps, tokens = result
        self.ttft.append(ttft)
        self.itl.extend(gaps)
        self.tokens += tokens

    def summary(self) -> dict:
        ms = lambda v: round(v * 1000, 2)  # noqa: E731
        return {
            "requests": len(self.ttft),
            "tokens": self.tokens,
            "ttft_p50_ms": ms(pct(self.ttft, 0.5)),
            "ttft_p99_ms": ms(pct(self.ttft, 0.99)),
            "ttft_mean_ms": ms(statistics.fmean(self.ttft)) if self.ttft else None,
            "itl_p50_ms": ms(pct(self.itl, 0.5)),
            "itl_p99_ms": ms(pct(self.itl, 0.99)),
        }


def concurrent_throughput(fn, n_requests: int, concurrency: int, max_tokens: int) -> dict:
    ps = prompts(n_requests)
    tokens = 0
    lock = threading.Lock()

    def one(p: str) -> None:
        nonlocal tokens
        _, _, t = fn(p)
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


# ------------------------------------------------------------------ servers


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(model_dir: Path, model_name: str, port: int, core: int, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--block-size", "32", "--enforce-eager", "--enable-prefix-caching",
        "--max-num-seqs", "64", "--disable-uvicorn-access-log",
    ]
    out = open(log, "wb")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM's server not ready after {timeout:.0f} s; see {log}")


def stop_group(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100, help="sequential requests per target (100)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds the requests are split into, alternating targets (5)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request (32)")
    ap.add_argument("--concurrency", type=int, default=8, help="streams at once in the throughput run (8; 0 skips it)")
    ap.add_argument("--skip-vllm", action="store_true", help="measure GaaS only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "openai_latency.json"))
    args = ap.parse_args(argv)

    import openai

    from gaas import topology
    from gaas.admin import Admin
    from gaas.client import GaasClient
    from gaas.mesh import Mesh, free_port_base
    from services.worker.engine import pin_descendants

    run_dir = Path(tempfile.mkdtemp(prefix="gaas-bench-"))
    base = free_port_base(span=200, start=42000)
    topo = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=base, ingress_port=base + 190, workers=1)
    mesh = Mesh(topo, run_dir=run_dir, deploy_file=ROOT / "deploy" / "gaas.yaml",
                redis_url=f"redis://127.0.0.1:{base + 191}/0", progress=say)
    model = mesh.spec.model(str(topo.of("worker")[0].options["model"]))
    core = sorted(os.sched_getaffinity(0))[0]  # where gaas pins worker-0
    vllm_procs: list[subprocess.Popen] = []
    results: dict = {}
    try:
        say(f"starting the GaaS mesh (logs in {run_dir / 'logs'})")
        mesh.start()
        mesh.wait_ready(300)
        with Admin(topo.of("control")[0].inbound) as admin:
            key, _ = admin.ensure_demo_key(run_dir)
        targets = {"gaas /v1 (openai client)": openai.OpenAI(base_url=f"http://{topo.ingress}/v1", api_key=key,
                                                              max_retries=0)}
        gaas_grpc = GaasClient(topo.ingress, api_key=key)
        if not args.skip_vllm:
            for variant in ("stock", "pinned"):
                port = free_port()
                log = run_dir / "logs" / f"vllm-openai-server-{variant}.log"
                say(f"starting vLLM's OpenAI server ({variant}) on 127.0.0.1:{port}, model runner on core {core} "
                    f"(log {log})")
                proc = start_vllm_server(Path(model.source), model.name, port, core, log)
                vllm_procs.append(proc)
                wait_http(f"http://127.0.0.1:{port}/health", proc, 300, log)
                name = "vllm openai server (openai client)"
                if variant == "pinned":
                    # The same placement gaas gives its workers: engine processes beside the runner,
                    # the API server on the other cores.
                    pin_descendants(proc.pid, {core})
                    others = set(os.sched_getaffinity(0)) - {core}
                    if others:
                        os.sched_setaffinity(proc.pid, others)
                    name = "vllm openai server, gaas's pinning"
                targets[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

        runners = {name: (lambda p, c=c: openai_stream(c, model.name, p, args.max_tokens)) for name, c in targets.items()}
        runners["gaas gRPC (gaas client)"] = lambda p: grpc_stream(gaas_grpc, model.name, p, args.max_tokens)
        series = {name: Series(name) for name in runners}

        say("warming up")
        for fn in runners.values():
            for p in prompts(5):
                fn(p)
        ps = prompts(args.requests)
        per_round = max(1, len(ps) // args.rounds)
        for r in range(0, len(ps), per_round):
            say(f"sequential requests {r + 1}-{min(r + per_round, len(ps))} of {len(ps)} on each target")
            for name, fn in runners.items():
                settle()
                for p in ps[r:r + per_round]:
                    series[name].add(fn(p))
        results["sequential"] = {name: s.summary() for name, s in series.items()}

        if args.concurrency > 0:
            results["concurrent"] = {}
            for name, fn in runners.items():
                settle()
                say(f"throughput: {args.concurrency} concurrent streams on {name}")
                results["concurrent"][name] = concurrent_throughput(fn, args.concurrency * 8, args.concurrency,
                                                                    args.max_tokens)
        gaas_grpc.close()
    finally:
        for proc in vllm_procs:
            stop_group(proc)
        say("stopping the mesh")
        mesh.stop()

    results["setup"] = {
        "model": model.name, "model_dir": model.source, "max_tokens": args.max_tokens, "worker_core": core,
        "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")

    print(f"\nStreamed completions, {model.name}, {args.max_tokens} tokens each, one request at a time "
          f"(worker and vLLM server pinned to core {core})\n")
    print(f"{'target':<38} {'reqs':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}   (ms)")
    for name, s in results["sequential"].items():
        print(f"{name:<38} {s['requests']:>5} {s['ttft_p50_ms']:>9} {s['ttft_p99_ms']:>9} {s['itl_p50_ms']:>8} "
              f"{s['itl_p99_ms']:>8}")
    if "concurrent" in results:
        print(f"\n{'target':<38} {'streams':>7} {'tokens':>7} {'tokens/s':>9}")
        for name, c in results["concurrent"].items():
            print(f"{name:<38} {c['concurrency']:>7} {c['tokens']:>7} {c['tokens_per_s']:>9}")
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
