"""The long-context switching cost (SITS2026 dimension 5): the time to the first token of a session's
next turn as its context grows from 1K tokens toward the model's 32K window, with the session's
prefix cached on the worker its turns are routed to, against the same conversation with nothing
cached; and the increment per added 1K tokens of context.

A mesh with one worker serving gaas-long (the tiny model's shape with a 32K context; built on first
use). For each context length: a session is started with a system prompt and a user message of
that many tokens; its next turns send one short message each (the stored context goes before it,
GaaS's sessions) and are timed as the openai client sees them (first streamed content). Not cached:
the same conversation (read back with GET /v1/gaas/sessions/ID), with a nonce at the start of its
system prompt so that no block of it is in any cache, sent as the first turn of a new session with
the same short message. The ratio cached / not cached is the share of the switching cost the
prefix cache leaves.

Prints a table and writes bench/results/sessions.json.

    python -m bench.sessions [--lengths 1024,2048,4096,8192,16384,31744] [--turns 3] [--uncached 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

from bench.common.output import RESULTS, progress, write_json

MODEL = "gaas-long"
# The short message each measured turn adds, tokens.
TURN_TOKENS = 24
REPLY_TOKENS = 8


say = progress("sessions")


def corpus_ids(tok, need: int) -> list[int]:
    from gaas.model.build import corpus_lines

    ids: list[int] = []
    for text in corpus_lines(16 << 20):
        ids += tok.encode(text, False)
        if len(ids) >= need:
            return ids
    return ids


def timed_turn(client, session: str, messages: list[dict]) -> dict:
    """One streamed turn: TTFT as the client sees it, and the usage and session the mesh reports."""
    started = time.perf_counter()
    first = None
    usage = turn = None
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=REPLY_TOKENS, stream=True, stream_options={"include_usage": True},
        extra_headers={"x-gaas-session": session}, extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter()
        if chunk.model_extra.get("gaas_session"):
            turn = chunk.model_extra["gaas_session"]
        if chunk.usage:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"ttft_ms": (first - started) * 1000, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached or 0,
            "session": turn}


def fit(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def measure(base_url: str, key: str, tok, lengths: list[int], turns: int, uncached: int, say) -> list[dict]:
    """For each context length: a session started with that much context, `turns` next turns timed
    with it cached, `uncached` with nothing of it cached (module docstring); a row per length."""
    import httpx
    import openai

    ids = corpus_ids(tok, max(lengths) + 64 * (turns + uncached + 4))
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=600)
    http = httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {key}"}, timeout=30)
    cursor = max(lengths)
    rows = []

    def short() -> str:
        nonlocal cursor
        piece = tok.decode(ids[cursor: cursor + TURN_TOKENS])
        cursor = (cursor + TURN_TOKENS) % (len(ids) - TURN_TOKENS)
        return piece

    say("warming up")
    timed_turn(client, f"warm-{uuid.uuid4().hex[:8]}", [{"role": "user", "content": short()}])
    for length in lengths:
        session = f"len{length}-{uuid.uuid4().hex[:8]}"
        system = f"Session {session}. Answer from the document."
        opening = tok.decode(ids[: max(1, length - 64)])
        say(f"{length} tokens: starting a session with a {length}-token context")
        start = timed_turn(client, session, [{"role": "system", "content": system},
                                             {"role": "user", "content": opening}])
        cached = [timed_turn(client, session, [{"role": "user", "content": short()}]) for _ in range(turns)]
        cold = []
        for _ in range(uncached):
            held = http.get(f"/v1/gaas/sessions/{session}").json()["messages"]
            held[0]["content"] = f"{uuid.uuid4().hex} " + held[0]["content"]  # nothing of it is cached anywhere
            cold.append(timed_turn(client, f"cold-{uuid.uuid4().hex[:8]}", held + [{"role": "user", "content": short()}]))
        row = {
            "context_tokens": length,
            "first_turn_ttft_ms": round(start["ttft_ms"], 2),
            "cached_ttft_ms": [round(t["ttft_ms"], 2) for t in cached],
            "cached_prompt_tokens": [t["prompt_tokens"] for t in cached],
            "cached_tokens": [t["cached_tokens"] for t in cached],
            "uncached_ttft_ms": [round(t["ttft_ms"], 2) for t in cold],
            "uncached_prompt_tokens": [t["prompt_tokens"] for t in cold],
            "uncached_cached_tokens": [t["cached_tokens"] for t in cold],
        }
        row["cached_p50_ms"] = round(statistics.median(row["cached_ttft_ms"]), 2)
        row["uncached_p50_ms"] = round(statistics.median(row["uncached_ttft_ms"]), 2)
        row["ratio"] = round(row["cached_p50_ms"] / row["uncached_p50_ms"], 3)
        rows.append(row)
        say(f"{length} tokens: next turn {row['cached_p50_ms']:.1f} ms cached, {row['uncached_p50_ms']:.1f} ms not "
            f"({row['ratio']:.2f}x)")
    http.close()
    return rows


def summarize(rows: list[dict]) -> dict:
    """The rows, the increment per added 1K tokens (cached and not), and the switch from the first
    length of 4K or more to the longest."""
    xs = [r["context_tokens"] / 1000 for r in rows]
    result = {
        "model": MODEL, "turn_tokens": TURN_TOKENS, "reply_tokens": REPLY_TOKENS, "rows": rows,
        "per_1k_tokens_ms": {"cached": round(fit(xs, [r["cached_p50_ms"] for r in rows]), 3),
                             "uncached": round(fit(xs, [r["uncached_p50_ms"] for r in rows]), 3)},
    }
    by_len = {r["context_tokens"]: r for r in rows}
    small = next((n for n in sorted(by_len) if n >= 4096), None)
    if small is not None and max(by_len) > small:
        big = max(by_len)
        result["switch"] = {
            "from_tokens": small, "to_tokens": big,
            "cached_ms": round(by_len[big]["cached_p50_ms"] - by_len[small]["cached_p50_ms"], 2),
            "uncached_ms": round(by_len[big]["uncached_p50_ms"] - by_len[small]["uncached_p50_ms"], 2),
            # The next turn at the longest context, cached, against the same prompt prefilled cold.
            "cached_to_cold": by_len[big]["ratio"],
            "cached_turn_ms": by_len[big]["cached_p50_ms"], "cold_prefill_ms": by_len[big]["uncached_p50_ms"],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,31744",
                    help="context lengths in tokens (default 1K to 31K of the 32K window)")
    ap.add_argument("--turns", type=int, default=3, help="timed next turns per length, cached (3)")
    ap.add_argument("--uncached", type=int, default=2, help="timed turns per length with nothing cached (2)")
    ap.add_argument("--out", default=str(RESULTS / "sessions.json"))
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]

    from bench.common.mesh import bench_mesh, demo_key, running
    from gaas.model.tokenizer import Tokenizer

    mesh = bench_mesh("sessions", 23000, say, serve_model=MODEL)
    say(f"starting a mesh with one worker serving {MODEL} (logs in {mesh.run_dir / 'logs'})")
    with running(mesh, 400):
        tok = Tokenizer.load(mesh.spec.model(MODEL).source)
        rows = measure(f"http://{mesh.topo.ingress}", demo_key(mesh), tok, lengths, args.turns, args.uncached, say)
    result = summarize(rows)
    print(f"\nNext turn's TTFT by session context ({MODEL}; one worker; {TURN_TOKENS}-token turns; p50 of "
          f"{args.turns} cached and {args.uncached} uncached turns):\n")
    print(f"{'context':>8} {'prompt':>8} {'cached':>8} {'TTFT cached':>12} {'TTFT not cached':>16} {'ratio':>6}")
    for r in rows:
        print(f"{r['context_tokens']:>8} {r['cached_prompt_tokens'][-1]:>8} {r['cached_tokens'][-1]:>8} "
              f"{r['cached_p50_ms']:>9.1f} ms {r['uncached_p50_ms']:>13.1f} ms {r['ratio']:>6.2f}")
    per = result["per_1k_tokens_ms"]
    print(f"\nper added 1K tokens of context: {per['cached']:.2f} ms cached, {per['uncached']:.2f} ms not cached")
    if "switch" in result:
        s = result["switch"]
        print(f"switching cost {s['from_tokens'] // 1024}K -> {s['to_tokens'] // 1024}K: +{s['cached_ms']:.1f} ms "
              f"cached, +{s['uncached_ms']:.1f} ms not cached (seed 003: 19 ms for 4K -> 32K; 48 ms for vLLM with a "
              "custom router)")
    write_json(args.out, result)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
