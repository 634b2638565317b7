"""Pre-cycle: the KV directory's answer for the prompt's blocks (asked for when the prompt was
tokenized, so that it overlapped the tenant's admission), into the context the prefix scorer reads."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.scheduling.types import Candidate, PreCycle, RequestContext


class PrefixLookup(PreCycle):
    name = "prefix-lookup"

    async def before(self, ctx: RequestContext, candidates: Sequence[Candidate]) -> None:
        if ctx.prefix_lookup is not None:
            ctx.prefix, ctx.confirmed = await ctx.prefix_lookup
