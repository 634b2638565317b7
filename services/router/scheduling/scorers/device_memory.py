"""Free device memory: the share of the worker's GPU memory (RAM on a CPU worker) not in use, in
steps of 5% (workers sharing one host's RAM report it a moment apart: a difference of a fraction
of a percent must stay a tie, broken at random, not decide every pick); neutral (0.5) when the
worker has not reported it."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, RequestContext, Scorer


@plugin("scorer")
class DeviceMemoryScorer(Scorer):
    name = "device_memory"

    def score(self, ctx: RequestContext, c: Candidate) -> float:
        if not c.load.memory_total:
            return 0.5
        return round(20 * (1.0 - c.load.memory_used / c.load.memory_total)) / 20
