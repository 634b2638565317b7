"""Issue 45's anchor row: what a gateway written for speed adds in front of vLLM, beside what GaaS adds.

Measures, in one run, on one model and one load, three targets:

  vllm server   vLLM's OpenAI server alone (the worker's engine settings and placement, as bench.cost
                starts it);
  vllm-router   the same server behind the vLLM project's Rust router (vllm-router, PyPI; installed
                into the venv if missing, as bench.routing does), --policy round_robin, one backend;
                the client talks to the router's port;
  gaas mesh     the GaaS mesh on the direct path, one worker pinned to a core (bench.cost's).

  1. --concurrency streams at once (8), --stream-requests requests (128-token prompts, 128-token
     answers): CPU per output token of the front processes (the server's API process; that and the
     router; every mesh process), engines and each process's background apart (bench.cost.measure),
     and each as a ratio to the server alone;
  2. --requests requests one at a time (128+32), sent to the targets in turn: TTFT p50 (from the
     request's start to its first streamed text) and the ms it adds to the server alone's.

Every request is /v1/completions, streamed, greedy, ignore_eos, its prompt exactly --input-len tokens
of random text (bench.cost.make_prompts); each target gets prompts of its own, so that the server,
shared by the first two targets, never finds one in its prefix cache. Prints the table beside issue
45's figures (vllm-router measured there at 1.28x CPU per token and +0.67 ms TTFT p50; GaaS's goal:
<= 1.25x CPU per token on this load) and writes bench/results/anchor.json. Every request must succeed
(the exit status is 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import cost
from bench.common.output import RESULTS, finish, progress
from bench.common.stats import percentile

say = progress("anchor")

# Issue 45's figures for vllm-router in front of vLLM's server, and GaaS's goal on this load.
ROUTER_RATIO_WAS = 1.28
ROUTER_TTFT_ADDED_WAS_MS = 0.67
GAAS_RATIO_GOAL = 1.25
ORDER = ("vllm", "router", "gaas")  # the table's rows; the first is what the others are compared with
NAMES = {"vllm": "vllm server alone", "router": "vllm-router + vllm server", "gaas": "gaas mesh"}


def start_router(server: cost.Target, log_dir: Path, stack: list) -> cost.Target:
    """vllm-router in front of server, on the cores of the server's API process; its Target (the
    API process and the router counted, the API process's engine apart)."""
    from bench.common.vllm import free_port, stop_group, wait_http
    from bench.routing import ensure_vllm_router

    binary = ensure_vllm_router()
    port, log = free_port(), log_dir / "vllm-router.log"
    say(f"starting vllm-router on 127.0.0.1:{port}, round_robin over {server.url} (log {log})")
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                                 "--worker-urls", server.url], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    stack.append(lambda: stop_group(proc))
    wait_http(f"http://127.0.0.1:{port}/health", proc, 60, log)
    api = server.pids["api server"]
    os.sched_setaffinity(proc.pid, os.sched_getaffinity(api))
    return cost.Target(NAMES["router"], f"http://127.0.0.1:{port}", None,
                       {"api server": api, "vllm-router": proc.pid}, {"api server"})


def ttft_one(client, target: cost.Target, model: str, prompt: str, max_tokens: int) -> float:
    """One streamed completion to its end; seconds from sending it to its first text. Raises
    RuntimeError if the stream is not whole (as bench.cost.stream_one)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {target.key}"} if target.key else {}
    first, usage, done = None, None, False
    start = time.perf_counter()
    with client.stream("POST", f"{target.url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    if not done or not usage or first is None:
        raise RuntimeError("the stream ended without text, [DONE] and a usage chunk")
    if usage["completion_tokens"] != max_tokens:
        raise RuntimeError(f"{usage['completion_tokens']} tokens instead of {max_tokens}")
    return first - start


def ttfts(targets: dict[str, cost.Target], model: str, prompts: dict[str, list[str]], max_tokens: int) -> dict:
    """Each target's requests one at a time, the targets taking turns request by request (so the
    host's drift falls on all alike): each target's TTFT p50 / p90 (ms) and failures."""
    import httpx

    seen: dict[str, list[float]] = {k: [] for k in targets}
    failed: dict[str, list[str]] = {k: [] for k in targets}
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        for i in range(min(len(p) for p in prompts.values())):
            for key, target in targets.items():
                time.sleep(0.2)
                try:
                    seen[key].append(ttft_one(client, target, model, prompts[key][i], max_tokens))
                except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
                    failed[key].append(f"{type(exc).__name__}: {exc}")
    return {k: {"requests": len(v), "ttft_p50_ms": round(percentile(v, 0.5) * 1000, 2),
                "ttft_p90_ms": round(percentile(v, 0.9) * 1000, 2), "failed": len(failed[k]),
                "failures": failed[k][:5]} for k, v in seen.items()}


def table(results: dict) -> list[dict]:
    """One row per target: CPU us per output token, its ratio to the server alone, TTFT p50, added ms."""
    streams, one = results["streams"], results["one_at_a_time"]
    base_cpu = (streams.get("vllm") or {}).get("us_per_token")
    base_ttft = (one.get("vllm") or {}).get("ttft_p50_ms")
    rows = []
    for key in ORDER:
        cpu, ttft = (streams.get(key) or {}).get("us_per_token"), (one.get(key) or {}).get("ttft_p50_ms")
        rows.append({"target": NAMES[key], "key": key, "us_per_token": cpu,
                     "ratio": round(cpu / base_cpu, 2) if cpu and base_cpu else None, "ttft_p50_ms": ttft,
                     "added_ttft_p50_ms": round(ttft - base_ttft, 2) if ttft is not None and base_ttft else None})
    return rows


def report(results: dict) -> None:
    s = results["setup"]
    print(f"\nissue 45's anchor row, {s['model']}: CPU per output token, {s['concurrency']} streams of "
          f"{s['input_len']}+{s['stream_output_len']} ({s['stream_requests']} requests each; engines and background "
          f"apart); TTFT p50, one at a time, {s['input_len']}+{s['output_len']} ({s['requests']} requests each)\n")
    print(f"{'target':<28} {'CPU us/token':>13} {'/ server':>9} {'TTFT p50 ms':>12} {'added ms':>9}  issue 45")
    notes = {"router": f"vllm-router was {ROUTER_RATIO_WAS}x, +{ROUTER_TTFT_ADDED_WAS_MS} ms",
             "gaas": f"goal <= {GAAS_RATIO_GOAL}x"}

    def f(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for row in results["table"]:
        key = row["key"]
        verdict = ""
        if key == "gaas" and row["ratio"] is not None:
            verdict = " (met)" if row["ratio"] <= GAAS_RATIO_GOAL else " (NOT MET)"
        print(f"{row['target']:<28} {f(row['us_per_token'], '.1f'):>13} {f(row['ratio'], '.2f') + ('x' if row['ratio'] is not None else ''):>9} "
              f"{f(row['ttft_p50_ms'], '.1f'):>12} {f(row['added_ttft_p50_ms'], '+.2f'):>9}  "
              f"{notes.get(key, '')}{verdict}")
    for key, c in results["streams"].items():
        print(f"  {NAMES[key]}, CPU s by process: "
              + ", ".join(f"{n} {v:.2f}" for n, v in c["seconds"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30,
                    help="one-at-a-time requests per target for the TTFT p50 (30; 0 skips that part)")
    ap.add_argument("--stream-requests", type=int, default=32,
                    help="requests per target in the CPU-per-token run, --concurrency at a time (32; 0 skips it)")
    ap.add_argument("--concurrency", type=int, default=8, help="streams at once in the CPU-per-token run (8)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds the CPU-per-token run of each target is split into "
                    "(2; the CPU of each round is read apart, the background measured once before)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (128)")
    ap.add_argument("--stream-output-len", type=int, default=128, help="tokens per answer in the CPU run (128)")
    ap.add_argument("--output-len", type=int, default=32, help="tokens per answer in the TTFT run (32)")
    ap.add_argument("--skip-gaas", action="store_true",
                    help="only vLLM's server and vllm-router (the mesh still starts, as bench.cost.start_targets "
                    "reads the model and the worker's engine settings from it, but is stopped before measuring)")
    ap.add_argument("--out", default=str(RESULTS / "anchor.json"),
                    help="where the JSON goes (bench/results/anchor.json)")
    args = ap.parse_args(argv)

    results: dict = {"streams": {}, "one_at_a_time": {}}
    stack: list = []
    try:
        targets, model, model_dir, core = cost.start_targets(argparse.Namespace(path="direct", skip_vllm=False),
                                                             stack)
        if args.skip_gaas:
            del targets["gaas"]
            stack.pop(0)()  # the mesh's stop
        log_dir = Path(tempfile.mkdtemp(prefix="gaas-anchor-"))
        targets["router"] = start_router(targets["vllm"], log_dir, stack)
        targets = {k: targets[k] for k in ORDER if k in targets}
        # Prompts of each target's own: warm-up, one at a time, streams.
        sizes = [2, args.requests, args.stream_requests]
        flat = cost.make_prompts(model_dir, sum(sizes) * len(targets), args.input_len, seed=4545)
        per = {k: flat[i * sum(sizes):(i + 1) * sum(sizes)] for i, k in enumerate(targets)}
        for key, target in targets.items():
            say(f"warming up {target.name}")
            warmed = cost.drive(target, model, per[key][:2], args.output_len, 1)
            if warmed.failed:
                raise RuntimeError(f"{target.name} failed its warm-up: {warmed.failed[0]}")
        if args.stream_requests > 0:
            for key, target in targets.items():
                say(f"{target.name}: {args.stream_requests} requests, {args.concurrency} at a time, "
                    f"{args.input_len}+{args.stream_output_len}, in {args.rounds} rounds")
                results["streams"][key] = cost.measure(
                    {key: target}, model, per[key][2 + args.requests:], args.stream_output_len, args.concurrency,
                    args.rounds, {}, Path(args.out).with_suffix(""), {core})[key]
        if args.requests > 0:
            say(f"{args.requests} requests one at a time on each target, {args.input_len}+{args.output_len}")
            results["one_at_a_time"] = ttfts(targets, model, {k: per[k][2:2 + args.requests] for k in targets},
                                             args.output_len)
    finally:
        for stop in reversed(stack):
            stop()

    results["setup"] = {
        "model": model, "input_len": args.input_len, "stream_output_len": args.stream_output_len,
        "output_len": args.output_len, "requests": args.requests, "stream_requests": args.stream_requests,
        "concurrency": args.concurrency, "rounds": args.rounds, "router_policy": "round_robin",
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    results["table"] = table(results)
    results["issue_45"] = {"vllm_router_ratio_was": ROUTER_RATIO_WAS,
                           "vllm_router_ttft_added_ms_was": ROUTER_TTFT_ADDED_WAS_MS, "gaas_ratio_goal": GAAS_RATIO_GOAL}
    return finish(args.out, results, [*results["streams"].values(), *results["one_at_a_time"].values()], report)


if __name__ == "__main__":
    sys.exit(main())
