"""Queue depth: 1 for an idle worker, halving as the requests ahead reach half_at, and so on."""

from dataclasses import dataclass

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, RequestContext, Scorer


@plugin("scorer")
@dataclass
class QueueScorer(Scorer):
    # Requests ahead at which the score is 0.5.
    half_at: float = 4.0
    name: str = "queue"

    def score(self, ctx: RequestContext, c: Candidate) -> float:
        return 1.0 / (1.0 + ctx.queue(c) / self.half_at)
