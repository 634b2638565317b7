"""The highest total score; ties broken at random (so equal workers share the load)."""

import random
from collections.abc import Mapping, Sequence

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Picker, RequestContext, WorkerId

# Scores this close count as equal.
TIE = 1e-9


@plugin("picker")
class MaxScorePicker(Picker):
    name = "max_score"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, ctx: RequestContext, candidates: Sequence[Candidate], scores: Mapping[WorkerId, float]) -> Candidate:
        best = max(scores.get(c.worker_id, 0.0) for c in candidates)
        top = [c for c in candidates if scores.get(c.worker_id, 0.0) >= best - TIE]
        return top[0] if len(top) == 1 else self._rng.choice(top)
