"""LoRA affinity: a request served with an adapter goes where the adapter is loaded (1), else where
the engine has room to load it without evicting another (0.5), else where loading it evicts the
least recently used one (0). What a worker holds: its load report's adapters, and those this router
sent it lately (hooks/adapters_sent.py). Requests without an adapter score 1 everywhere."""

from dataclasses import dataclass

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, RequestContext, Scorer

FREE_SLOT = 0.5


@plugin("scorer")
@dataclass
class AdapterAffinityScorer(Scorer):
    name: str = "adapter_affinity"

    def score(self, ctx: RequestContext, c: Candidate) -> float:
        if not ctx.adapter:
            return 1.0
        held = c.load.adapters | ctx.adapters_sent.get(c.worker_id, frozenset())
        if ctx.adapter in held:
            return 1.0
        return FREE_SLOT if len(held) < c.load.adapter_slots else 0.0
