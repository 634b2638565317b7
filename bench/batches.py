"""Batches on a live mesh (gaas-tiny, two workers, the direct path), through the ingress with the
official client:

  idle      a batch of --idle-items chat requests (--max-tokens each) on an otherwise idle mesh:
            its throughput (items/s, output tokens/s) from creation to completion
  gold      a gold tenant's interactive TTFT (streamed chats, --gold-requests one after another,
            --gold-gap s apart), without any batch, then while a batch of --items requests runs
            (the issue's goal: p95 within 1.2x); and that batch's own completion time and
            throughput beside the gold traffic

Every item is checked once in the output file, and the batch's ledger rows counted (billed once).
Prints a table and writes bench/results/batches.json.

    python -m bench.batches [--items 1000] [--idle-items 200] [--gold-requests 60]
"""

from __future__ import annotations

import argparse
import io
import json
import threading
import time

from bench.common.mesh import admin, bench_mesh, running, tenant_key
from bench.common.output import RESULTS, progress, write_json
from bench.common.stats import percentile

say = progress("batches")
MODEL = "gaas-tiny"


def batch_file(n: int, max_tokens: int) -> bytes:
    return "\n".join(json.dumps({
        "custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Summarize document number {i}."}],
                 "max_tokens": max_tokens, "ignore_eos": True}}) for i in range(n)).encode()


def run_batch(client, n: int, max_tokens: int, timeout: float = 3600) -> dict:
    """A batch of n requests created and waited for: its seconds, counts and output tokens."""
    f = client.files.create(file=("bench.jsonl", io.BytesIO(batch_file(n, max_tokens))), purpose="batch")
    started = time.perf_counter()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    return wait(client, b.id, n, started, timeout)


def wait(client, batch_id: str, n: int, started: float, timeout: float = 3600) -> dict:
    last = -1
    while True:
        b = client.batches.retrieve(batch_id)
        done = b.request_counts.completed + b.request_counts.failed
        if done != last and done % 100 < 5:
            say(f"batch {batch_id[:14]}...: {done}/{n}")
        last = done
        if b.status in ("completed", "failed", "expired", "cancelled"):
            break
        if time.perf_counter() - started > timeout:
            raise SystemExit(f"batch {batch_id} did not finish in {timeout:.0f} s")
        time.sleep(0.5)
    seconds = time.perf_counter() - started
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()] if b.output_file_id else []
    tokens = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert len({x["custom_id"] for x in out}) == len(out), "an item answered twice"
    return {"id": batch_id, "status": b.status, "items": n, "completed": b.request_counts.completed,
            "failed": b.request_counts.failed, "seconds": round(seconds, 1),
            "items_per_s": round(b.request_counts.completed / seconds, 2), "output_tokens_per_s": round(tokens / seconds, 1)}


def gold_ttfts(client, n: int, gap: float, stop: threading.Event | None = None) -> list[float]:
    """TTFT ms of n streamed chats, one after another, gap s apart (fewer when stop is set)."""
    out = []
    for i in range(n):
        if stop is not None and stop.is_set():
            break
        started = time.perf_counter()
        first = None
        for chunk in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"An interactive question, number {i}."}],
                max_tokens=16, stream=True, temperature=0):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        out.append(((first or time.perf_counter()) - started) * 1000)
        time.sleep(gap)
    return out


def summary(ttfts: list[float]) -> dict:
    return {"requests": len(ttfts), "ttft_ms_p50": round(percentile(ttfts, 0.5), 1),
            "ttft_ms_p95": round(percentile(ttfts, 0.95), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1000, help="requests of the batch beside gold traffic (1000)")
    ap.add_argument("--idle-items", type=int, default=200, help="requests of the batch on an idle mesh (200)")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens of each batch request (16)")
    ap.add_argument("--gold-requests", type=int, default=60, help="gold's interactive requests per figure (60)")
    ap.add_argument("--gold-gap", type=float, default=0.2, help="seconds between gold's requests (0.2)")
    ap.add_argument("--out", default=str(RESULTS / "batches.json"))
    args = ap.parse_args(argv)
    mesh = bench_mesh("batches", 25400, say, workers=2, ingress_path="direct")
    with running(mesh, 300):
        import openai

        with admin(mesh) as a:
            gold = tenant_key(a, "interactive", "gold")
            batcher = tenant_key(a, "pipeline", "bronze")
        g = openai.OpenAI(base_url=f"http://{mesh.topo.ingress}/v1", api_key=gold, max_retries=0, timeout=300)
        b = openai.OpenAI(base_url=f"http://{mesh.topo.ingress}/v1", api_key=batcher, max_retries=2, timeout=300)
        gold_ttfts(g, 5, 0)  # warm
        say(f"idle: a batch of {args.idle_items} requests alone")
        idle = run_batch(b, args.idle_items, args.max_tokens)
        say(f"gold alone: {args.gold_requests} streamed chats")
        alone = summary(gold_ttfts(g, args.gold_requests, args.gold_gap))
        say(f"gold beside a batch of {args.items} requests")
        f = b.files.create(file=("bench.jsonl", io.BytesIO(batch_file(args.items, args.max_tokens))), purpose="batch")
        started = time.perf_counter()
        batch = b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        time.sleep(2.0)  # (the batch running at full width first)
        beside = summary(gold_ttfts(g, args.gold_requests, args.gold_gap))
        still_running = b.batches.retrieve(batch.id).status == "in_progress"
        busy = wait(b, batch.id, args.items, started)
        from gaas.sdk.admin import BillingAdmin

        with BillingAdmin(mesh.topo.of("billing")[0].inbound) as billing:
            deadline = time.monotonic() + 60
            while (rows := billing.usage("pipeline")["total"]["requests"]) < idle["completed"] + busy["completed"] \
                    and time.monotonic() < deadline:
                time.sleep(0.5)
    ratio = round(beside["ttft_ms_p95"] / alone["ttft_ms_p95"], 2)
    doc = {"model": MODEL, "workers": 2, "ingress_path": "direct", "max_tokens": args.max_tokens,
           "idle_batch": idle, "gold_alone": alone, "gold_beside_batch": beside, "batch_beside_gold": busy,
           "batch_ran_through_gold_measurement": still_running, "gold_ttft_p95_ratio": ratio, "goal_ratio": 1.2,
           "ledger_rows_of_batch_tenant": rows, "items_run": idle["completed"] + busy["completed"]}
    write_json(args.out, doc)
    print(f"\nBatches (gaas-tiny, 2 workers, direct path, through the ingress; {args.out})")
    print(f"  batch on an idle mesh:    {idle['items']} requests in {idle['seconds']} s: {idle['items_per_s']} items/s, "
          f"{idle['output_tokens_per_s']} output tokens/s")
    print(f"  batch beside gold:        {busy['items']} requests in {busy['seconds']} s: {busy['items_per_s']} items/s, "
          f"{busy['output_tokens_per_s']} output tokens/s")
    print(f"  gold TTFT alone:          p50 {alone['ttft_ms_p50']} ms, p95 {alone['ttft_ms_p95']} ms")
    print(f"  gold TTFT beside batch:   p50 {beside['ttft_ms_p50']} ms, p95 {beside['ttft_ms_p95']} ms "
          f"({ratio}x; goal 1.2x){'' if still_running else ' (the batch finished before gold did)'}")
    print(f"  billed once:              {rows} ledger rows for {doc['items_run']} items run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
