"""Dimension 5, the long-context switching cost (the worker's engine and the router's sessions):
a session's next turn at 4K and at 32K tokens of context, with its context cached on the worker its
turns go to, against the same conversation sent with nothing cached (bench/sessions.py's workload
and figures); the switch 4K -> 32K in ms, and the cached turn as a share of a cold prefill."""

from __future__ import annotations

from pathlib import Path

from bench import sessions
from bench.sits.card import Dimension
from bench.sits.target import Target

LENGTHS = [4096, 31744]


def measure(t: Target, say, quick: bool = False) -> Dimension:
    from gaas.launcher.mesh import ROOT
    from gaas.model.tokenizer import Tokenizer

    d = Dimension("long_context_switch")
    model = next((m for m in t.models() if m["name"] == sessions.MODEL), None)
    if model is None or not t.workers(sessions.MODEL):
        d.error = (f"the target serves no {sessions.MODEL} (a 32K-context model); the scorecard's own mesh "
                   "serves one (leave --target out), or serve it: replicas: 1 in the deployment file")
        return d
    _, key = t.tenant("switch", "gold")
    source = Path(model["source"])
    tok = Tokenizer.load(source if source.is_absolute() else ROOT / source)
    turns = 2 if quick else 3
    rows = sessions.measure(t.base_url, key, tok, LENGTHS, turns, 1, lambda m: say(f"switching: {m}"))
    result = sessions.summarize(rows)
    d.figures = result
    s = result.get("switch")
    if s:
        d.cell = (f"+{s['cached_ms']:.0f} ms cached (+{s['uncached_ms']:.0f} ms cold); a cached 32K turn is "
                  f"{s['cached_to_cold']:.0%} of a cold prefill")
    return d
