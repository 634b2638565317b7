"""Workers that are not saturated: a long queue, or a KV cache nearly full (a new request would
evict what others reuse, or wait). Soft: when every worker is saturated, all stay candidates."""

from dataclasses import dataclass

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Filter, RequestContext


@plugin("filter")
@dataclass
class SaturationFilter(Filter):
    # Requests ahead (running + waiting + just sent) at which a worker counts as saturated.
    max_queue: int = 16
    # KV-cache usage at which a worker counts as saturated.
    max_kv_usage: float = 0.95
    name: str = "saturation"
    soft: bool = True

    def keep(self, ctx: RequestContext, c: Candidate) -> bool:
        return ctx.queue(c) < self.max_queue and c.load.kv_usage < self.max_kv_usage
