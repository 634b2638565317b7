"""Prefix overlap: the share of the prompt's full blocks the worker already holds (confirmed by
its engine, or provisioned by a router's recent decision)."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, RequestContext, Scorer


@plugin("scorer")
class PrefixScorer(Scorer):
    name = "prefix"
    needs_prefix = True

    def score(self, ctx: RequestContext, c: Candidate) -> float:
        if not ctx.block_hashes:
            return 0.0
        return ctx.prefix.get(c.worker_id, 0) / len(ctx.block_hashes)
