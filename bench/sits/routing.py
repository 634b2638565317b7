"""Dimension 1, GPU-aware routing (the router's): which signals the scheduler weighs (and which the
workers report on this host), what one decision costs (the routers' own scheduler and KV-lookup
histograms over the workload), and the TTFT gain over round robin on a skewed load.

The skewed load: heavy requests (a ~1,500-token prompt, 192 tokens out) and light ones (~20 tokens,
8 out) alternate, arriving as a Poisson stream at a rate set by the fleet's measured capacity: the
heavy ones at LOAD (70%) of the heavy requests a second the workers finish together, kept busy
(calibrate). Round robin sends every heavy request to one worker and every light one to the other:
more heavy work than one worker keeps up with, while the other idles; a scheduler that reads the
workers' queues and KV use spreads it within what the fleet serves. (A fixed rate measured the
host's speed that day instead: past the fleet's capacity every policy's queue grows alike.) Measured on the scorecard's own mesh with its routers as deploy/'s settings make them, then
with every router restarted as round robin (and back)."""

from __future__ import annotations

import asyncio
import random
import time

from bench.sits.card import Dimension, Unmeasured
from bench.sits.common import histogram_delta, histogram_quantile, ttft_summary
from bench.sits.load import closed_loop, open_loop, poisson, stream, text
from bench.sits.target import OwnMeshOnly, Target

MODEL = "gaas-tiny"
HEAVY_TOKENS, HEAVY_OUT = 1500, 192
LIGHT_TOKENS, LIGHT_OUT = 20, 8
# The heavy requests' share of the fleet's capacity, the heavy streams a worker is kept busy with
# while that is measured, for how long, and the most requests a second the load generator sends.
LOAD, BUSY_PER_WORKER, CALIBRATE_S, MAX_RATE = 0.7, 4, 15.0, 50.0

# The signals a scheduler could weigh: the scorer that weighs it (gaas/settings/router.py's
# profiles) and whether a worker's load report carries it.
SIGNALS = {
    "queue (running + waiting)": ("queue", lambda w: True),
    "KV-cache use": ("kv_usage", lambda w: w["load"]["kv_cache_blocks"] > 0),
    "prefix held (KV directory)": ("prefix", lambda w: True),
    "device memory free": ("device_memory", lambda w: w["load"]["device_memory_total"] > 0),
    "device utilisation": ("", lambda w: w["load"]["device_utilization"] > 0),
    "interconnect (NVLink peers)": ("", lambda w: bool(w["load"].get("nvlink_peers"))),
}


def skewed(seconds: float, rate: float, seed: int = 7) -> list[tuple[float, str, str]]:
    """(at, kind, prompt) of the skewed load: heavy and light alternating, unique prompts."""
    rng = random.Random(seed)
    out = []
    for i, at in enumerate(poisson(rng, rate, seconds)):
        heavy = i % 2 == 0
        out.append((at, "heavy" if heavy else "light",
                    f"{i} {rng.random()} " + text(rng, HEAVY_TOKENS if heavy else LIGHT_TOKENS)))
    return out


def _send(key: str, kind: str, prompt: str):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": HEAVY_OUT if kind == "heavy" else LIGHT_OUT,
            "ignore_eos": True, "temperature": 0}
    return lambda c: stream(c, key, body, kind=kind, explain=True)


def calibrate(t: Target, key: str, workers: int, seconds: float = CALIBRATE_S) -> dict:
    """The fleet's capacity for heavy requests (a second, BUSY_PER_WORKER streams a worker kept
    busy, unique prompts) and the skewed load's rate from it."""
    rng = random.Random(3)

    def send(c):
        return _send(key, "heavy", f"calibrate {rng.random()} " + text(rng, HEAVY_TOKENS))(c)

    return load_rate(asyncio.run(closed_loop(t.base_url, BUSY_PER_WORKER * workers, seconds, send)))


def load_rate(done: list) -> dict:
    """The heavy requests a second the fleet finished (between the first one's end and the last's:
    kept busy, not filling up) and the skewed load's rate at LOAD of it."""
    ends = sorted(o.started + o.ms / 1000 for o in done if o.ok)
    heavy_per_s = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 2 and ends[-1] > ends[0] else 0.0
    # Heavy and light alternate: twice the heavy rate.
    rate = min(MAX_RATE, max(0.5, round(2 * LOAD * heavy_per_s, 2)))
    return {"heavy_per_s_at_capacity": round(heavy_per_s, 2), "load": LOAD, "per_s": rate}


def run_load(t: Target, key: str, plan) -> tuple[list, float]:
    """The plan's requests as timed (the outcomes, and the seconds the load took)."""
    started = time.perf_counter()
    outcomes = asyncio.run(open_loop(t.base_url, [(at, _send(key, kind, p)) for at, kind, p in plan]))
    return outcomes, time.perf_counter() - started


def summary(runs: list[tuple[list, float]]) -> dict:
    """TTFT percentiles of the runs' outcomes pooled, by kind too, and output tokens per second."""
    outcomes = [o for run, _ in runs for o in run]
    out = ttft_summary(outcomes)
    for kind in ("heavy", "light"):
        out[kind] = ttft_summary([o for o in outcomes if o.kind == kind])
    out["output_tokens_per_s"] = round(sum(o.completion_tokens for o in outcomes if o.ok)
                                       / sum(seconds for _, seconds in runs), 1)
    out["rounds"] = len(runs)
    return out


def policy_of(metrics: dict) -> str:
    """The policy the routers ran (routed_total's label), the one that routed the most."""
    counts: dict[str, float] = {}
    for labels, value in metrics.get("gaas_router_routed_total", ()):
        counts[labels.get("policy", "")] = counts.get(labels.get("policy", ""), 0.0) + value
    return max(counts, key=counts.get) if counts else ""


def measure(t: Target, say, quick: bool = False) -> Dimension:
    from gaas.settings.router import PROFILES

    d = Dimension("gpu_aware_routing")
    seconds = 10.0 if quick else 20.0
    _, key = t.tenant("routing", "gold")
    workers = t.workers(MODEL)
    if len(workers) < 2:
        d.error = f"the target serves {MODEL} on {len(workers)} worker(s); comparing routing needs two or more"
        return d
    say("routing: warming up, then the fleet's capacity for heavy requests")
    run_load(t, key, skewed(2.0, 2.0, seed=1))
    capacity = calibrate(t, key, len(workers), CALIBRATE_S / 2 if quick else CALIBRATE_S)
    rate = capacity["per_s"]
    say(f"routing: {capacity['heavy_per_s_at_capacity']:g} heavy requests/s at capacity; {seconds:.0f} s of skewed "
        f"load at {rate:g} requests/s, {'once' if quick else 'twice'} with each policy")
    before = t.router_metrics()
    aware = [run_load(t, key, skewed(seconds, rate))]
    after = t.router_metrics()
    policy = policy_of(after)
    weights = PROFILES[policy].weights if policy in PROFILES else {}
    reported = {name: any(check(w) for w in t.workers(MODEL)) for name, (_, check) in SIGNALS.items()}
    on_cpu = all(w["load"].get("device_kind", "cpu") in ("", "cpu") for w in t.workers(MODEL))
    d.figures["policy"] = policy
    d.figures["load"] = {"seconds": seconds, **capacity, "heavy": [HEAVY_TOKENS, HEAVY_OUT],
                         "light": [LIGHT_TOKENS, LIGHT_OUT]}
    d.figures["signals"] = [{"signal": name, "scorer": scorer or None,
                             "weight": weights.get(scorer) if scorer else None,
                             "reported_here": reported[name],
                             **({"note": "a CPU worker reports its RAM and its cores' load"}
                                if on_cpu and name.startswith("device") and reported[name] else {})}
                            for name, (scorer, _) in SIGNALS.items()]
    for name, (scorer, _) in SIGNALS.items():
        if not reported[name]:
            d.unmeasured.append(Unmeasured(f"signal: {name}", "no worker of this host reports it (a CPU worker "
                                           "has no NVML device)" if "NVLink" not in name else
                                           "NVML reports no NVLink peer here", "a GPU host (make gpu-check)"
                                           if "NVLink" not in name else "a host whose GPUs are linked by NVLink"))
    plugins = histogram_delta(before, after, "gaas_router_scheduler_plugin_seconds", "plugin")
    lookup = histogram_delta(before, after, "gaas_router_kv_lookup_seconds")
    decisions = max((c for _, c in plugins.values()), default=0.0)
    if decisions:
        per_plugin = {p: round(s / decisions * 1000, 4) for p, (s, c) in sorted(plugins.items()) if c}
        lookup_ms = sum(s for s, _ in lookup.values()) / max(1.0, sum(c for _, c in lookup.values())) * 1000
        lookup_p99 = histogram_quantile(before, after, "gaas_router_kv_lookup_seconds", 0.99)
        stale_p99 = histogram_quantile(before, after, "gaas_router_kv_replica_staleness_seconds", 0.99)
        d.figures["decision"] = {"decisions": int(decisions), "scheduler_ms": round(sum(per_plugin.values()), 4),
                                 "kv_lookup_ms": round(lookup_ms, 4),
                                 # Bucket bounds: the p99 is at most this (the router's own replica,
                                 # and how stale it was: an engine's event to its change there).
                                 "kv_lookup_p99_ms_at_most": None if lookup_p99 is None else lookup_p99 * 1000,
                                 "kv_replica_staleness_p99_ms_at_most": None if stale_p99 is None else stale_p99 * 1000,
                                 "total_ms": round(sum(per_plugin.values()) + lookup_ms, 4),
                                 "per_plugin_ms": per_plugin}
    else:
        d.unmeasured.append(Unmeasured("decision cost", "the routers' metrics had no scheduler timings",
                                       "a mesh whose routers serve /metrics"))
    try:
        # The rounds in the order A B B A, so that a drift of the host's load weighs on both alike.
        with t.routers_with({"GAAS_ROUTER_POLICY": "round_robin"}):
            say("routing: the routers restarted as round robin, the same load again")
            run_load(t, key, skewed(2.0, 2.0, seed=2))
            rr = [run_load(t, key, skewed(seconds, rate, seed=7 + i)) for i in range(1 if quick else 2)]
        if not quick:
            say(f"routing: {policy} again")
            aware.append(run_load(t, key, skewed(seconds, rate, seed=8)))
        d.figures["round_robin"] = summary(rr)
    except OwnMeshOnly as exc:
        d.unmeasured.append(Unmeasured("TTFT gain over round robin", str(exc), "the scorecard's own mesh"))
    d.figures[policy or "mesh policy"] = summary(aware)
    if "round_robin" in d.figures:
        a, r = d.figures[policy or "mesh policy"], d.figures["round_robin"]
        if r["ttft_p95_ms"] and a["ttft_p95_ms"]:
            d.figures["ttft_p95_gain"] = round(1 - a["ttft_p95_ms"] / r["ttft_p95_ms"], 3)
            d.figures["ttft_p50_gain"] = round(1 - a["ttft_p50_ms"] / r["ttft_p50_ms"], 3)
    used = [s["signal"].split(" (")[0] for s in d.figures["signals"] if s["weight"] and s["reported_here"]]
    gain = d.figures.get("ttft_p95_gain")
    cost = d.figures.get("decision", {}).get("total_ms")
    d.cell = (f"yes ({', '.join(used)})" + (f"; {cost:.2f} ms a decision" if cost is not None else "")
              + (f"; TTFT p95 {-gain:+.0%} vs round robin" if gain is not None else ""))
    return d
