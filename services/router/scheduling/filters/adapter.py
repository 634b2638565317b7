"""Workers whose engine serves LoRA adapters, for a request served with one (a pool whose engine
settings set no max_loras serves none)."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Filter, RequestContext


@plugin("filter")
class AdapterFilter(Filter):
    name = "adapter"

    def keep(self, ctx: RequestContext, c: Candidate) -> bool:
        return not ctx.adapter or c.load.adapter_slots > 0

    def why(self, ctx: RequestContext) -> str:
        return (f"no worker of {ctx.model} serves LoRA adapters (asked for {ctx.adapter!r}); its pool needs "
                "engine: {max_loras: N} in the deployment file")
