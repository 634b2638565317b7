"""Workers whose circuit breaker lets requests through (services/router/breakers.py). Soft: when
every worker's breaker is open they are tried anyway rather than refusing."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Filter, RequestContext


@plugin("filter")
class BreakerFilter(Filter):
    name = "breaker"
    soft = True

    def keep(self, ctx: RequestContext, c: Candidate) -> bool:
        return c.worker_id not in ctx.blocked
