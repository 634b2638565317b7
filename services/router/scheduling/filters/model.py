"""Workers that serve the request's model."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Filter, RequestContext


@plugin("filter")
class ModelFilter(Filter):
    name = "model"

    def keep(self, ctx: RequestContext, c: Candidate) -> bool:
        return c.model == ctx.model

    def why(self, ctx: RequestContext) -> str:
        return f"no worker is serving {ctx.model!r} right now; retry in a few seconds"
