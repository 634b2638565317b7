"""Admission and QoS under overload: gold, silver and bronze tenants offering together twice what
the fleet serves within its TTFT target, with the router's flow control on (tier bands, batching windows, the queue) and
off (every request straight to an engine at the priority its client asked for). Per tier: TTFT
p50/p95/p99 (time to the first streamed token, as the client sees it), throughput, requests shed
(503) and timed out in the queue (504). The goal: gold's p95 TTFT within 1.5x of its unloaded
value, and gold never shed.

Then rate-limit accuracy across two router replicas: a tenant with a requests-per-minute quota
sends as fast as it can through the ingress (which spreads requests over both routers) for a
minute; the requests admitted must be the quota within 2%.

Prints tables and writes bench/results/qos.json.

    python -m bench.qos [--seconds 30] [--load 2.0] [--skip-ratelimit]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from bench import footprint
from bench.common import sse
from bench.common.mesh import admin, bench_mesh, running, tenant_key
from bench.common.output import RESULTS, ROOT, progress, write_json
from bench.common.stats import parts_p50_p95, percentile
from gaas.contracts.tenancy import TIERS_BY_PRIORITY
from gaas.ops.topology import INGRESS_PATHS

MODEL = "gaas-tiny"
TIERS = TIERS_BY_PRIORITY  # gold, silver, bronze: the order the load generator draws them in
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega river stone cloud window garden paper signal engine market thread").split()


say = progress("qos")


def prompt(rng: random.Random, words: int = 90) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(client: aiohttp.ClientSession, key: str, text: str, max_tokens: int) -> dict:
    """One streamed completion: outcome, TTFT (ms), tokens, and where the mesh says its time went
    (gaas.contracts.latency's parts, asked for with x-gaas-explain)."""
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    started = time.perf_counter()
    ttft, tokens, parts = None, 0, None
    try:
        async with client.post("/v1/completions", json=body, headers=sse.bearer(key, {"x-gaas-explain": "1"})) as r:
            if r.status != 200:
                await r.read()
                kind = {503: "shed", 504: "timed_out", 429: "rate_limited"}.get(r.status, f"http_{r.status}")
                return {"outcome": kind, "ms": (time.perf_counter() - started) * 1000}
            async for chunk in sse.events(r):
                if "error" in chunk:
                    return {"outcome": "failed", "ms": (time.perf_counter() - started) * 1000}
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    tokens += 1
                    if ttft is None:
                        ttft = (time.perf_counter() - started) * 1000
                if (chunk.get("usage") or {}).get("gaas_latency_ms"):
                    parts = chunk["usage"]["gaas_latency_ms"]
    except sse.CLIENT_ERRORS as exc:
        return {"outcome": f"client_{type(exc).__name__}", "ms": (time.perf_counter() - started) * 1000}
    return {"outcome": "ok", "ttft_ms": ttft or 0.0, "tokens": tokens, "ms": (time.perf_counter() - started) * 1000,
            "parts": parts}


async def closed_loop(base: str, keys: dict, streams: int, seconds: float, max_tokens: int) -> tuple[float, float]:
    """(requests/s completed, TTFT p95 ms) with `streams` clients always waiting on one."""
    rng = random.Random(1)
    ttfts: list[float] = []
    deadline = time.perf_counter() + seconds
    async with sse.session(base, connections=streams + 8, timeout=120) as c:
        async def loop(i: int) -> None:
            while time.perf_counter() < deadline:
                r = await one(c, keys[TIERS[i % 3]][0], prompt(rng), max_tokens)
                if r["outcome"] == "ok":
                    ttfts.append(r["ttft_ms"])
        started = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(streams)))
        return len(ttfts) / (time.perf_counter() - started), percentile(ttfts, 0.95)


async def capacity_at_target(base: str, keys: dict, target_ms: float, seconds: float, max_tokens: int) -> dict:
    """What the fleet serves while TTFT p95 stays within target_ms: closed loops of 1, 2, 4, ...
    streams until the p95 passes it; the rate of the last one within it."""
    sweep, best = [], 0.0
    for streams in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        rate, p95 = await closed_loop(base, keys, streams, seconds, max_tokens)
        sweep.append({"streams": streams, "per_s": round(rate, 2), "ttft_p95_ms": round(p95, 1)})
        say(f"  {streams} streams: {rate:.1f} requests/s, TTFT p95 {p95:.0f} ms")
        if p95 > target_ms:
            break
        best = rate
    # Even one stream past the target (a noisy machine): one stream's rate is the capacity.
    return {"per_s": best or sweep[0]["per_s"], "sweep": sweep}


async def unloaded(base: str, key: str, n: int, max_tokens: int) -> list[dict]:
    """n requests one at a time: the ones served."""
    rng = random.Random(2)
    out = []
    async with sse.session(base, timeout=60) as c:
        for _ in range(n):
            r = await one(c, key, prompt(rng), max_tokens)
            if r["outcome"] == "ok":
                out.append(r)
    return out


async def open_loop(base: str, keys: dict, rate: float, seconds: float, max_tokens: int) -> dict:
    """Poisson arrivals at `rate`/s, tiers in equal shares, each tier's tenants in turn."""
    rng = random.Random(3)
    results: dict[str, list[dict]] = {t: [] for t in TIERS}
    turn = {t: 0 for t in TIERS}
    tasks = []
    async with sse.session(base, connections=2000, timeout=120) as c:
        async def run(tier: str, key: str, text: str) -> None:
            r = await one(c, key, text, max_tokens)
            r["ended"] = time.perf_counter()
            results[tier].append(r)

        started = time.perf_counter()
        next_at = started
        while next_at - started < seconds:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tier = TIERS[rng.randrange(3)]
            key = keys[tier][turn[tier] % len(keys[tier])]
            turn[tier] += 1
            tasks.append(asyncio.create_task(run(tier, key, prompt(rng))))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    # Served per second while the fleet was serving: from the first arrival to the last request
    # served (not to the last one shed or timed out in a queue, seconds later).
    served_until = max((r["ended"] for rs in results.values() for r in rs if r["outcome"] == "ok"), default=started)
    elapsed = max(1e-9, served_until - started)
    out = {}
    for tier, rs in results.items():
        ok = [r for r in rs if r["outcome"] == "ok"]
        ttfts = [r["ttft_ms"] for r in ok]
        outcomes: dict[str, int] = {}
        for r in rs:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        out[tier] = {
            "offered": len(rs), "served": len(ok), "served_per_s": round(len(ok) / elapsed, 2),
            "ttft_p50_ms": round(percentile(ttfts, 0.5), 1), "ttft_p95_ms": round(percentile(ttfts, 0.95), 1),
            "ttft_p99_ms": round(percentile(ttfts, 0.99), 1), "shed": outcomes.get("shed", 0),
            "timed_out": outcomes.get("timed_out", 0),
            "other_failures": sum(v for k, v in outcomes.items() if k not in ("ok", "shed", "timed_out")),
            "outcomes": outcomes, "latency_ms": parts_p50_p95(r.get("parts") for r in ok),
        }
    return out


@contextmanager
def qos_mesh(qos_on: bool, workers: int, routers: int = 1, deploy_file: Path | None = None,
             ingress_path: str | None = None) -> Iterator[tuple]:
    """A mesh serving, with flow control on or off, and two unlimited tenants of each tier: (mesh, the
    ingress's URL, tier -> their keys); stopped and its run directory removed afterwards."""
    mesh = bench_mesh("qos", 24000, say, workers=workers, replicas={"router": routers}, deploy_file=deploy_file,
                      extra_env={"GAAS_QOS": "on" if qos_on else "off"}, ingress_path=ingress_path)
    with running(mesh, 400):
        with admin(mesh) as a:
            keys = {tier: [tenant_key(a, f"{tier}-{i}", tier) for i in range(2)] for tier in TIERS}
        yield mesh, f"http://{mesh.topo.ingress}", keys


def deploy_with_targets(gold_ms: float, out: Path) -> Path:
    """deploy/gaas.yaml with the tiers' TTFT targets set for this machine: gold's from what it gets
    alone, silver's and bronze's looser."""
    import yaml

    doc = yaml.safe_load((ROOT / "deploy" / "gaas.yaml").read_text())
    for tier, factor in (("gold", 1.0), ("silver", 4.0), ("bronze", 16.0)):
        doc.setdefault("qos", {}).setdefault(tier, {})["ttft_target_ms"] = round(gold_ms * factor, 1)
    # Paths in the file are relative to the project root, wherever the copy lives.
    for m in doc["models"]:
        if not str(m["source"]).startswith("/"):
            m["source"] = str(ROOT / m["source"])
    out.write_text(yaml.safe_dump(doc))
    return out


def overload(qos_on: bool, args, rate: float | None = None, deploy_file: Path | None = None) -> dict:
    """Gold alone, then (with no rate given) the fleet's capacity, then `args.load` times it offered
    for args.seconds."""
    mode = "on" if qos_on else "off"
    with qos_mesh(qos_on, args.workers, deploy_file=deploy_file, ingress_path=args.ingress_path) as (mesh, base, keys):
        say(f"QoS {mode}: warming up, then gold alone")
        asyncio.run(unloaded(base, keys["gold"][0], 10, args.max_tokens))
        alone_results = asyncio.run(unloaded(base, keys["gold"][0], args.unloaded, args.max_tokens))
        alone = [r["ttft_ms"] for r in alone_results]
        capacity = None
        if rate is None:
            target = 1.5 * percentile(alone, 0.95)
            say(f"QoS {mode}: what the fleet serves within TTFT p95 {target:.0f} ms (1.5x gold's alone)")
            capacity = asyncio.run(capacity_at_target(base, keys, target, args.capacity_seconds, args.max_tokens))
            rate = capacity["per_s"] * args.load
        say(f"QoS {mode}: offering {rate:.1f} requests/s for {args.seconds:.0f} s")
        cpu, host_before = os.times(), footprint.host_times()
        started = time.perf_counter()
        tiers = asyncio.run(open_loop(base, keys, rate, args.seconds, args.max_tokens))
        used, host = os.times(), footprint.host_load(host_before, footprint.host_times())
        client_cpu = (used.user + used.system - cpu.user - cpu.system) / (time.perf_counter() - started)
        from gaas.sdk.admin import router_flow

        return {"unloaded_gold_ttft_p50_ms": round(percentile(alone, 0.5), 1),
                "unloaded_gold_ttft_p95_ms": round(percentile(alone, 0.95), 1),
                "unloaded_gold_latency_ms": parts_p50_p95(r.get("parts") for r in alone_results),
                "capacity_per_s": round(capacity["per_s"], 2) if capacity else None,
                "capacity_sweep": capacity["sweep"] if capacity else None, "offered_per_s": round(rate, 2),
                "load_generator_cores": round(client_cpu, 2), "host": host, "tiers": tiers,
                "router_flow": router_flow(mesh.topo.of("router")[0].inbound)}


async def hammer(base: str, key: str, seconds: float, streams: int) -> tuple[int, int]:
    """(admitted, refused) of requests sent as fast as `streams` clients can for `seconds`."""
    admitted = refused = 0
    deadline = time.perf_counter() + seconds
    body = {"model": MODEL, "prompt": "count me", "max_tokens": 1}
    async with sse.session(base, timeout=30) as c:
        async def loop() -> None:
            nonlocal admitted, refused
            while time.perf_counter() < deadline:
                async with c.post("/v1/completions", json=body, headers=sse.bearer(key)) as r:
                    await r.read()
                if r.status == 200:
                    admitted += 1
                elif r.status == 429:
                    refused += 1
                    await asyncio.sleep(0.01)
        await asyncio.gather(*(loop() for _ in range(streams)))
    return admitted, refused


def rate_limit_accuracy(args) -> dict:
    with qos_mesh(True, args.workers, routers=2, ingress_path=args.ingress_path) as (mesh, base, _):
        with admin(mesh) as a:
            key = tenant_key(a, "metered", "silver", rpm=args.rpm)
        say(f"rate limit: {args.rpm} requests/min through 2 routers, 59 s as fast as 16 clients can")
        admitted, refused = asyncio.run(hammer(base, key, 59.0, 16))
        return {"routers": 2, "rpm_quota": args.rpm, "window_seconds": 59, "admitted": admitted,
                "refused": refused, "error_pct": round(100 * (admitted - args.rpm) / args.rpm, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # One engine on one core, the mesh (and this load generator) on the other: with a worker per
    # core every front end shares a core with a busy-waiting engine, and TTFT is CPU noise.
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--target-factor", type=float, default=1.0,
                   help="gold's TTFT target as a multiple of its p95 alone (1.0); silver 4x and bronze 16x gold's")
    p.add_argument("--seconds", type=float, default=30.0, help="length of the overload, s (30)")
    p.add_argument("--load", type=float, default=2.0, help="offered load as a multiple of capacity (2.0)")
    p.add_argument("--capacity-seconds", type=float, default=8.0,
                   help="length of each closed loop of the capacity sweep, s (8)")
    p.add_argument("--unloaded", type=int, default=40, help="gold requests alone for the baseline (40)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rpm", type=int, default=600, help="the quota of the rate-limit check (600)")
    p.add_argument("--skip-ratelimit", action="store_true")
    p.add_argument("--ingress-path", choices=INGRESS_PATHS, default=None,
                   help="the ingress's path to the workers (default: deploy/topology.yaml's)")
    p.add_argument("--out", default=str(RESULTS / "qos.json"))
    args = p.parse_args(argv)
    results = {"model": MODEL, "ingress_path": args.ingress_path or "topology's", "workers": args.workers, "max_tokens": args.max_tokens, "load": args.load,
               "seconds": args.seconds}
    # Without flow control first: the fleet's capacity, and what gold gets alone on this machine.
    results["qos_off"] = off = overload(False, args)
    gold_target = round(args.target_factor * off["unloaded_gold_ttft_p95_ms"], 1)
    results["gold_ttft_target_ms"] = gold_target
    with tempfile.TemporaryDirectory() as tmp:
        deploy = deploy_with_targets(gold_target, Path(tmp) / "gaas.yaml")
        results["qos_on"] = overload(True, args, rate=off["offered_per_s"], deploy_file=deploy)
    if not args.skip_ratelimit:
        results["rate_limit"] = rate_limit_accuracy(args)
    print(f"\n{'':8} {'tier':<7} {'served/s':>9} {'TTFT p50':>9} {'p95':>8} {'p99':>8} {'shed':>6} {'timeout':>8} {'other':>6}")
    for mode in ("qos_on", "qos_off"):
        r = results[mode]
        for tier in TIERS:
            t = r["tiers"][tier]
            print(f"{mode:<8} {tier:<7} {t['served_per_s']:>9} {t['ttft_p50_ms']:>9} {t['ttft_p95_ms']:>8} "
                  f"{t['ttft_p99_ms']:>8} {t['shed']:>6} {t['timed_out']:>8} {t['other_failures']:>6}")
        print(f"{mode:<8} gold alone: TTFT p50 {r['unloaded_gold_ttft_p50_ms']} ms, p95 {r['unloaded_gold_ttft_p95_ms']} "
              f"ms; offered {r['offered_per_s']} req/s" + (f" (capacity {r['capacity_per_s']})" if r["capacity_per_s"] else ""))
        for tier, parts in (("alone", r["unloaded_gold_latency_ms"]),
                            *((tier, r["tiers"][tier]["latency_ms"]) for tier in TIERS)):
            if parts:
                print(f"{'':8} {tier:<7} where the time went (ms, p50 / p95): "
                      + "  ".join(f"{k} {v['p50']:g} / {v['p95']:g}" for k, v in parts.items()))
    print(f"gold's TTFT target with QoS on: {results['gold_ttft_target_ms']} ms; the load generator used "
          f"{results['qos_on']['load_generator_cores']} of the machine's cores with QoS on, "
          f"{results['qos_off']['load_generator_cores']} off")
    for mode in ("qos_on", "qos_off"):
        print(f"  the host during the overload, QoS {mode[4:]}: {footprint.describe_host_load(results[mode]['host'])}")
    flow = results["qos_on"]["router_flow"] or {}
    for band in flow.get("bands", ()):
        print(f"  router queue, {band['band']}: {band['queued']} waited (p95 {band['wait_p95_ms']} ms), "
              f"{band['shed']} shed, {band['timed_out']} timed out")
    for w in flow.get("workers", ()):
        print(f"  {w['worker_id']}: window {w['window']} after {w['window_shrinks']} shrinks and {w['window_grows']} "
              f"grows; breaker {w['breaker']}")
    on = results["qos_on"]
    ratio = on["tiers"]["gold"]["ttft_p95_ms"] / max(1e-9, on["unloaded_gold_ttft_p95_ms"])
    results["gold_p95_vs_unloaded"] = round(ratio, 2)
    print(f"\ngold p95 TTFT at {args.load:g}x load / alone: {ratio:.2f}x (goal <= 1.5x); gold shed: "
          f"{on['tiers']['gold']['shed']} (goal 0)")
    if "rate_limit" in results:
        rl = results["rate_limit"]
        print(f"rate limit across {rl['routers']} routers: {rl['admitted']} admitted in {rl['window_seconds']} s "
              f"against {rl['rpm_quota']}/min ({rl['error_pct']:+.2f}%; goal within 2%)")
    write_json(args.out, results)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
