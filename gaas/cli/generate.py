"""`gaas generate`: stream one generation through the ingress with a tenant's API key, then its TTFT,
tokens and tokens/s (--json: one object), its session turn, and with --explain where its time went."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gaas.cli.common import DEFAULT_RUN_DIR, api_key, fail, ingress_address, ingress_tls, mesh_state


def cmd_generate(args) -> int:
    from gaas.sdk.client import GaasClient, GaasError

    target = ingress_address(args)
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    started = time.perf_counter()
    first = None
    tokens = 0
    text: list[str] = []
    final = None
    with GaasClient(target, api_key=api_key(args), **ingress_tls(args)) as client:
        try:
            stream = client.generate(
                prompt,
                # The mesh's own model unless one is named (the router would take the deployment's default).
                model=args.model or ((mesh_state(Path(args.run_dir)) or {}).get("models") or [""])[0],
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                stop=args.stop or (),
                priority=args.priority,
                timeout=args.timeout,
                session_id=args.session or "",
                messages=[("user", prompt)] if args.chat else None,
            )
            try:
                for chunk in stream:
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += len(chunk.token_ids)
                    text.append(chunk.text)
                    if not args.json:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                    if chunk.finish_reason:
                        final = chunk
            except KeyboardInterrupt:
                stream.cancel()
                print(file=sys.stderr)
                return fail("cancelled", 130)
        except GaasError as exc:
            if exc.code == "UNAVAILABLE" and "connect" in exc.message.lower():
                return fail(f"nothing answers at {target}: is the mesh up? (`make run` / `gaas up`)")
            return fail(f"{exc.code}: {exc.message}")
    elapsed = time.perf_counter() - started
    ttft_ms = (first - started) * 1000 if first else None
    decode_s = elapsed - (first - started) if first else 0
    rate = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None
    summary = {
        "text": "".join(text),
        "ttft_ms": round(ttft_ms, 2) if ttft_ms is not None else None,
        "tokens": tokens,
        "tokens_per_s": round(rate, 1) if rate else None,
        "seconds": round(elapsed, 4),
    }
    if final is not None:
        from gaas.contracts import finish

        summary.update(
            request_id=final.request_id,
            finish_reason=finish.label(final.finish_reason),
            model=final.model,
            model_version=final.model_version,
            worker=final.worker_id,
            usage={
                "prompt_tokens": final.usage.prompt_tokens,
                "cached_tokens": final.usage.cached_tokens,
                "completion_tokens": final.usage.completion_tokens,
            },
        )
        if final.timings.total_ms:
            from gaas.contracts import latency

            summary["latency_ms"] = latency.as_dict(final.timings)
        if final.timings.trace_id:
            summary["trace_id"] = final.timings.trace_id
        if final.HasField("session"):
            summary["session"] = _session_turn(final.session)
    if args.json:
        print(json.dumps(summary))
    else:
        parts = [
            f"TTFT {summary['ttft_ms']} ms" if ttft_ms is not None else "no tokens",
            f"{tokens} tokens",
        ]
        if rate:
            parts.append(f"{rate:.1f} tokens/s")
        if final is not None:
            parts += [f"{summary['finish_reason']}", f"{final.model} {final.model_version} on {final.worker_id}"]
        print(f"\n-- {' | '.join(parts)}", file=sys.stderr)
        if final is not None and final.HasField("session"):
            s = final.session
            dropped = (f"; {s.dropped_turns} oldest turn(s), about {s.dropped_tokens} tokens, dropped to fit the model's "
                       "context" if s.dropped_turns else "")
            print(f"-- session {s.session_id}{' (new)' if s.created else ''}: version {s.version}, {s.turns} turn(s), "
                  f"{s.context_tokens} tokens of context{dropped}", file=sys.stderr)
        if args.explain:
            _explain(final, elapsed)
    return 0


def _session_turn(s) -> dict:
    return {"id": s.session_id, "version": s.version, "turns": s.turns, "context_tokens": s.context_tokens,
            "created": s.created, "dropped_turns": s.dropped_turns, "dropped_tokens": s.dropped_tokens}


def _explain(final, elapsed: float) -> None:
    """Where the request's time went, as the mesh measured it (gaas.contracts.latency)."""
    from gaas.contracts import latency

    if final is None or not final.timings.total_ms:
        print("-- no latency decomposition came back (the request did not finish)", file=sys.stderr)
        return
    t = final.timings
    print(f"-- where the time went: {elapsed * 1000:.2f} ms here (connecting included), {t.total_ms:.2f} ms of it "
          f"measured in the mesh (ingress arrival to last token)", file=sys.stderr)
    for part in latency.PARTS:
        ms = latency.part_ms(t, part)
        extra = {"queue": f" (router queue {t.router_queue_ms:.2f})",
                 "net": f" (ingress to router {t.ingress_ms:.2f})"}.get(part, "")
        print(f"   {part:<8}{ms:>10.2f} ms {ms / t.total_ms:>6.1%}  {latency.MEANING[part]}{extra}", file=sys.stderr)
    if t.trace_id:
        print(f"-- its trace, hop by hop: gaas trace {t.trace_id}", file=sys.stderr)


def register(sub) -> None:
    """`gaas generate`."""
    gen = sub.add_parser("generate", help="stream a generation through the ingress",
                         description="Stream a generation: the text as it arrives, then TTFT, tokens and tokens/s.")
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    gen.add_argument("--model", default="", help="model name (default: what the running mesh serves)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (64)")
    gen.add_argument("--temperature", type=float, default=None, help="sampling temperature (engine default 1.0; 0 = greedy)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None, help="fix the sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--priority", choices=["low", "normal", "high"], default="normal")
    gen.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds (120)")
    gen.add_argument("--ingress", default=None, help="host:port of the ingress (env GAAS_INGRESS; default: the running mesh's)")
    gen.add_argument("--api-key", default=None, help="API key (env GAAS_API_KEY; default: the demo key `gaas up` saved)")
    gen.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help=argparse.SUPPRESS)
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, timings, usage, latency_ms) instead")
    gen.add_argument("--session", default=None, metavar="ID",
                     help="make this a turn of session ID (started by its first turn): GaaS keeps the conversation, "
                     "send only what is new")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message (the model's chat template), not as raw text")
    gen.add_argument("--explain", action="store_true",
                     help="after the text, print where the request's time went: tenant (auth, quota), router, queue, "
                     "prefill, decode, net")
    gen.set_defaults(func=cmd_generate)
