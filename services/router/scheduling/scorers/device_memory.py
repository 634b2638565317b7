"""Free device memory: the share of the worker's GPU memory (RAM on a CPU worker) not in use;
neutral (0.5) when the worker has not reported it."""

from services.router.scheduling.types import Candidate, RequestContext, Scorer


class DeviceMemoryScorer(Scorer):
    name = "device_memory"

    def score(self, ctx: RequestContext, c: Candidate) -> float:
        if not c.load.memory_total:
            return 0.5
        return 1.0 - c.load.memory_used / c.load.memory_total
