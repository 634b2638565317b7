"""Workers that have not failed this request."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Filter, RequestContext


@plugin("filter")
class NotTriedFilter(Filter):
    name = "not_tried"

    def keep(self, ctx: RequestContext, c: Candidate) -> bool:
        return c.worker_id not in ctx.tried

    def why(self, ctx: RequestContext) -> str:
        return f"every worker serving {ctx.model!r} failed this request; retry shortly"
