"""The scheduler: filters narrow the candidates, weighted scorers rate them, a picker chooses.
Pure and synchronous: everything it needs (loads, the directory's prefix answer) is in the
request context and the candidates by the time it runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gaas.contracts import errors
from services.router.scheduling.types import (
    Candidate, Filter, NoCapacity, Picker, RequestContext, Scorer, WorkerId, clamp,
)


@dataclass(frozen=True, slots=True)
class Decision:
    worker: Candidate
    # Total weighted score of every candidate that passed the filters.
    scores: dict[WorkerId, float]


class Scheduler:
    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        observe: Callable[[str, float], None] = lambda plugin, seconds: None,
    ) -> None:
        self.name = name
        self.filters = list(filters)
        self.scorers = [(s, w) for s, w in scorers if w > 0]
        self.picker = picker
        # Whether a directory lookup is worth making before scheduling.
        self.needs_prefix = any(s.needs_prefix for s, _ in self.scorers)
        self._observe = observe

    def schedule(self, ctx: RequestContext, candidates: Sequence[Candidate]) -> Decision:
        """The worker for ctx; errors.Unavailable (saying why) when no candidate may take it,
        NoCapacity when they may but none has room now."""
        clock = time.perf_counter
        kept = list(candidates)
        for f in self.filters:
            started = clock()
            passed = [c for c in kept if f.keep(ctx, c)]
            self._observe(f.name, clock() - started)
            if not passed:
                if f.soft and kept:
                    continue
                raise (NoCapacity if f.waitable else errors.Unavailable)(f.why(ctx))
            kept = passed
        scores = {c.worker_id: 0.0 for c in kept}
        for scorer, weight in self.scorers:
            started = clock()
            for c in kept:
                scores[c.worker_id] += weight * clamp(scorer.score(ctx, c))
            self._observe(scorer.name, clock() - started)
        started = clock()
        worker = self.picker.pick(ctx, kept, scores)
        self._observe(self.picker.name, clock() - started)
        return Decision(worker, scores)
