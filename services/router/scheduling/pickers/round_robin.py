"""Each model's workers in turn (ordered by id, so replicas agree on the order)."""

import itertools
from collections.abc import Mapping, Sequence

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Picker, RequestContext, WorkerId


@plugin("picker")
class RoundRobinPicker(Picker):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, ctx: RequestContext, candidates: Sequence[Candidate], scores: Mapping[WorkerId, float]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        return ordered[next(self._counter) % len(ordered)]
