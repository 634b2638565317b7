"""Workers whose dynamic batching window has room for a request of this band now
(services/router/windows.py). Waitable: when none has, the request waits in the router's queue."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Filter, RequestContext


@plugin("filter")
class WindowFilter(Filter):
    name = "window"
    waitable = True

    def keep(self, ctx: RequestContext, c: Candidate) -> bool:
        return ctx.room is None or ctx.room.get(c.worker_id, 1) > 0

    def why(self, ctx: RequestContext) -> str:
        return f"every worker serving {ctx.model!r} is at its batching window"
