"""What structured output costs, on a live mesh (gaas-tiny, one worker, the direct path), through the
ingress with the official client: chat requests streamed, each figure over --requests requests.

  free            no constraint: 32 tokens (ignore_eos)
  json schema     response_format json_schema, an array of 16 one-digit integers (33 tokens), the
                  same schema every time (xgrammar compiles it once, then takes it from its cache)
  new schema      the same, with a schema text never seen before on each request (compiled for it)
  named tool      tool_choice naming a function of that array as its parameter: the call's
                  arguments constrained, read into tool_calls by the worker
  regex           structured_outputs regex [a-z]{32}

Per workload: TTFT p50 / p95 one request at a time, and output tokens/s of --concurrency streams at
once (tokens after each stream's first, over the time they took). Prints a table and writes
bench/results/structured.json.

    python -m bench.structured [--requests 30] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from bench.common.mesh import admin, bench_mesh, running, tenant_key
from bench.common.output import RESULTS, progress, write_json
from bench.common.stats import percentile

say = progress("structured")
MODEL = "gaas-tiny"
MESSAGES = [{"role": "user", "content": "Give me sixteen digits."}]


def _digits(n: int = 16, most: int = 9, note: str = "") -> dict:
    return {"type": "object", **({"description": note} if note else {}), "properties": {"d": {"type": "array", "minItems": n, "maxItems": n,
                                                   "items": {"type": "integer", "minimum": 0, "maximum": most}}},
            "required": ["d"], "additionalProperties": False}


def workloads() -> dict:
    """name -> request number -> the create() keyword arguments beyond model, messages and stream."""
    fixed = {"response_format": {"type": "json_schema", "json_schema": {"name": "digits", "schema": _digits()}}}
    tool = {"type": "function", "function": {"name": "record", "parameters": _digits()}}
    return {
        "free": lambda i: {"max_tokens": 32, "extra_body": {"ignore_eos": True}},
        "json schema": lambda i: {"max_tokens": 64, **fixed},
        # (a description never sent before: a schema text of its own, compiled for this request)
        "new schema": lambda i: {"max_tokens": 64, "response_format": {"type": "json_schema", "json_schema": {
            "name": "digits", "schema": _digits(note=f"request {i} at {time.time_ns()}")}}},
        "named tool": lambda i: {"max_tokens": 64, "tools": [tool],
                                 "tool_choice": {"type": "function", "function": {"name": "record"}}},
        "regex": lambda i: {"max_tokens": 64, "extra_body": {"structured_outputs": {"regex": "[a-z]{32}"}}},
    }


def one(client, kwargs: dict) -> tuple[float, float, int]:
    """(TTFT ms, seconds from the first token to the last, completion tokens) of one streamed chat."""
    started = time.perf_counter()
    first = last = None
    tokens = 0
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, temperature=0,
                                                stream_options={"include_usage": True}, **kwargs):
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls):
            first = first if first is not None else now
            last = now
    if first is None:
        return float("nan"), 0.0, tokens
    return (first - started) * 1000, last - first, tokens


def throughput(client, make, n: int, concurrency: int) -> float:
    """Output tokens/s of n requests, concurrency at a time."""
    lock, done, tokens = threading.Lock(), [0], [0]

    def run() -> None:
        while True:
            with lock:
                if done[0] >= n:
                    return
                i = done[0]
                done[0] += 1
            _, _, t = one(client, make(1000 + i))
            with lock:
                tokens[0] += t

    started = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0] / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="requests per figure (30)")
    ap.add_argument("--concurrency", type=int, default=8, help="streams at once for tokens/s (8)")
    ap.add_argument("--out", default=str(RESULTS / "structured.json"))
    args = ap.parse_args(argv)
    mesh = bench_mesh("structured", 25000, say, workers=1, ingress_path="direct")
    rows: dict = {}
    with running(mesh, 300):
        import openai

        with admin(mesh) as a:
            key = tenant_key(a, "structured", "gold")
        c = openai.OpenAI(base_url=f"http://{mesh.topo.ingress}/v1", api_key=key, max_retries=0, timeout=300)
        loads = workloads()
        for make in loads.values():  # warm: every path once (a fixed schema compiled once)
            one(c, make(0))
        ttfts: dict[str, list[float]] = {name: [] for name in loads}
        tokens: dict[str, list[int]] = {name: [] for name in loads}
        say(f"TTFT: {args.requests} requests of each workload, one at a time, in alternating rounds")
        for i in range(args.requests):
            for name, make in loads.items():
                ttft, _, t = one(c, make(i + 1))
                ttfts[name].append(ttft)
                tokens[name].append(t)
        for name, make in loads.items():
            say(f"tokens/s: {name}, {args.requests} requests, {args.concurrency} at once")
            rows[name] = {
                "ttft_ms_p50": round(percentile(ttfts[name], 0.5), 1),
                "ttft_ms_p95": round(percentile(ttfts[name], 0.95), 1),
                "completion_tokens_mean": round(statistics.mean(tokens[name]), 1),
                "tokens_per_s": round(throughput(c, make, args.requests, args.concurrency), 1),
            }
    free = rows["free"]
    for name, row in rows.items():
        row["ttft_vs_free"] = round(row["ttft_ms_p50"] / free["ttft_ms_p50"], 2)
        row["tokens_per_s_vs_free"] = round(row["tokens_per_s"] / free["tokens_per_s"], 2)
    doc = {"model": MODEL, "workers": 1, "ingress_path": "direct", "requests": args.requests,
           "concurrency": args.concurrency, "workloads": rows}
    write_json(args.out, doc)
    print(f"\nStructured output (gaas-tiny, 1 worker, direct path, through the ingress; {args.out})")
    print(f"  {'workload':<12} {'TTFT p50':>9} {'p95':>8} {'x free':>7} {'tokens':>7} {'tokens/s':>9} {'x free':>7}")
    for name, r in rows.items():
        print(f"  {name:<12} {r['ttft_ms_p50']:>7} ms {r['ttft_ms_p95']:>5} ms {r['ttft_vs_free']:>7} "
              f"{r['completion_tokens_mean']:>7} {r['tokens_per_s']:>9} {r['tokens_per_s_vs_free']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
