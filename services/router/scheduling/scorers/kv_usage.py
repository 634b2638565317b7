"""KV-cache headroom: the share of the worker's cache blocks not in use."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, RequestContext, Scorer


@plugin("scorer")
class KVUsageScorer(Scorer):
    name = "kv_usage"

    def score(self, ctx: RequestContext, c: Candidate) -> float:
        return 1.0 - c.load.kv_usage
