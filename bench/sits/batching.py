"""Dimension 3, the dynamic batching window (the router's latency loop, the engines' continuous
batching): a step load with the loop on and off. Gold requests arrive steadily; bronze steps from a
trickle to a flood and back. On: each worker's window (the requests a router lets it batch) shrinks
when a tier's TTFT p95 passes its target and grows back when it is met, and what does not fit waits
in the router's queue, gold first. Off: every router restarted with the window fixed at its ceiling
(GAAS_WINDOW_MIN = GAAS_WINDOW_MAX), so every request goes straight to its engine's own batching.
Per phase and tier: TTFT p95 against the tier's target, as the client saw it and as the mesh measured
it (x-gaas-explain: everything before the first token, from the ingress's arrival; on a host whose
cores the mesh shares with the load generator, the client's own lag moves both tiers alike by
seconds in some runs, and only the mesh's figure says what the loop did); throughput; and the
windows' trace, read from the routers every half second."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time

from bench.common.stats import percentile
from bench.sits.card import Dimension, Unmeasured
from bench.sits.load import open_loop, poisson, stream, text
from bench.sits.target import OwnMeshOnly, Target
from gaas.contracts.latency import PARTS

MODEL = "gaas-tiny"
PROMPT_TOKENS, OUT_TOKENS = 90, 32
# The ceiling the loop works within (gaas/settings/router.py's GAAS_WINDOW_MAX default).
WINDOW_CEILING = 64


def phases(quick: bool) -> list[tuple[str, float, float, float]]:
    """(name, seconds, gold per s, bronze per s) of the step load."""
    if quick:
        return [("before", 5.0, 2.0, 2.0), ("step", 10.0, 2.0, 30.0), ("after", 5.0, 2.0, 2.0)]
    return [("before", 8.0, 2.0, 2.0), ("step", 16.0, 2.0, 30.0), ("after", 8.0, 2.0, 2.0)]


def plan(quick: bool, seed: int = 5) -> list[tuple[float, str, str, str]]:
    """(at, phase, tier, prompt) of every request of the step load."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for name, seconds, gold, bronze in phases(quick):
        for tier, rate in (("gold", gold), ("bronze", bronze)):
            out += [(at, name, tier, f"{tier} {rng.random()} " + text(rng, PROMPT_TOKENS))
                    for at in poisson(rng, rate, seconds, start)]
        start += seconds
    return sorted(out)


class WindowTrace:
    """Each of the workers' window and requests in flight, summed over the routers, every interval."""

    def __init__(self, t: Target, workers: set[str], interval: float = 0.5) -> None:
        self.t, self.workers, self.interval = t, workers, interval
        self.points: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WindowTrace:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            windows: dict[str, dict] = {}
            for f in self.t.flows():
                for w in f["workers"]:
                    if w["worker_id"] not in self.workers:
                        continue
                    cur = windows.setdefault(w["worker_id"], {"window": 0.0, "in_flight": 0})
                    cur["window"] += w["window"]
                    cur["in_flight"] += w["in_flight"]
            self.points.append({"t": round(time.perf_counter() - self.started, 2), "workers": windows})


def mesh_ttft_ms(parts: dict) -> float:
    """A request's time to its first token as the mesh measured it, from the ingress's arrival: the
    load generator's own lag left out (a mesh older than the "ttft" figure: the total less the decode,
    which counts the usage event's writing after the last token too)."""
    return parts["ttft"] if "ttft" in parts else parts["total"] - parts["decode"]


def slowest_parts(parts: list[dict], share: float = 0.1) -> dict:
    """Where the slowest tenth of a tier's first tokens spent their time: each part's mean (ms) over
    the requests whose mesh-measured TTFT is in that tenth (the decode left out)."""
    slow = sorted(parts, key=mesh_ttft_ms)[-max(1, math.ceil(len(parts) * share)):] if parts else []
    return {p: round(sum(x.get(p, 0.0) for x in slow) / len(slow), 1) for p in PARTS if p != "decode"} if slow else {}


def run(t: Target, keys: dict[str, str], quick: bool) -> dict:
    def send(tier: str, name: str, prompt: str):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": OUT_TOKENS, "ignore_eos": True, "temperature": 0}
        return lambda c: stream(c, keys[tier], body, kind=f"{name}/{tier}", explain=True)

    schedule = plan(quick)
    with WindowTrace(t, {w["worker_id"] for w in t.workers(MODEL)}) as trace:
        started = time.perf_counter()
        outcomes = asyncio.run(open_loop(t.base_url, [(at, send(tier, name, p)) for at, name, tier, p in schedule]))
        elapsed = time.perf_counter() - started
    out: dict = {"phases": {}, "trace": trace.points}
    for name, *_ in phases(quick):
        row = {}
        for tier in ("gold", "bronze"):
            mine = [o for o in outcomes if o.kind == f"{name}/{tier}"]
            ok = [o.ttft_ms for o in mine if o.ok and o.ttft_ms]
            mesh = [mesh_ttft_ms(o.parts) for o in mine if o.ok and o.parts]
            target = t.ttft_target_ms(tier)
            p95 = percentile(ok, 0.95)
            mesh_p95 = percentile(mesh, 0.95) if mesh else None
            row[tier] = {"requests": len(mine), "served": len(ok), "refused": sum(1 for o in mine if not o.ok),
                         "ttft_p95_ms": round(p95, 1), "mesh_ttft_p95_ms": round(mesh_p95, 1) if mesh else None,
                         "target_ms": target, "within_target": bool(mesh) and mesh_p95 <= target,
                         "slowest_parts_ms": slowest_parts([o.parts for o in mine if o.ok and o.parts])}
        out["phases"][name] = row
    served = [o for o in outcomes if o.ok]
    out["requests_per_s"] = round(len(served) / elapsed, 2)
    out["output_tokens_per_s"] = round(sum(o.completion_tokens for o in served) / elapsed, 1)
    out["refused"] = sum(1 for o in outcomes if not o.ok)
    windows = [w["window"] for p in trace.points for w in p["workers"].values()]
    out["window_min"] = min(windows) if windows else None
    out["window_max"] = max(windows) if windows else None
    return out


def measure(t: Target, say, quick: bool = False) -> Dimension:
    d = Dimension("dynamic_batching")
    keys = {tier: t.tenant(f"batching-{tier}", tier)[1] for tier in ("gold", "bronze")}
    total = sum(p[1] for p in phases(quick))
    flows = t.flows()
    if not flows or not flows[0].get("qos_enabled"):
        d.error = "the target's routers run without flow control (GAAS_QOS=off): no window to measure"
        return d
    say(f"batching: {total:.0f} s step load (bronze 2 -> 30 -> 2 requests/s beside 2/s of gold), the loop on")
    d.figures["loop_on"] = run(t, keys, quick)
    try:
        fixed = str(WINDOW_CEILING)
        with t.routers_with({"GAAS_WINDOW_MIN": fixed, "GAAS_WINDOW_MAX": fixed, "GAAS_WINDOW_INITIAL": fixed}):
            say("batching: the routers restarted with the window fixed at its ceiling (the loop off), the same load")
            d.figures["loop_off"] = run(t, keys, quick)
    except OwnMeshOnly as exc:
        d.unmeasured.append(Unmeasured("the same load with the loop off", str(exc), "the scorecard's own mesh"))
    on = d.figures["loop_on"]["phases"]["step"]["gold"]
    off = (d.figures.get("loop_off") or {}).get("phases", {}).get("step", {}).get("gold")

    def ms(v) -> str:
        return "-" if v is None else f"{v:.0f}"

    d.cell = (f"yes (latency feedback loop): gold TTFT p95 in the step {ms(on['mesh_ttft_p95_ms'])} ms on"
              + (f" / {ms(off['mesh_ttft_p95_ms'])} ms off" if off else "") + f" (target {on['target_ms']:.0f} ms; "
              f"as the mesh measured it; the client saw {on['ttft_p95_ms']:.0f}"
              + (f" / {off['ttft_p95_ms']:.0f}" if off else "") + "); "
              f"window {d.figures['loop_on']['window_min']:g}-{d.figures['loop_on']['window_max']:g}")
    return d
