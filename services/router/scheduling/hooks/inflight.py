"""Pre-cycle: requests this router sent each worker since the worker's last load report, which
that report cannot know yet (so a burst does not pile onto the worker that looked idle)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.router.scheduling.types import Candidate, PreCycle, RequestContext, WorkerId


class InflightSince(PreCycle):
    name = "inflight"

    def __init__(self, since: Callable[[WorkerId, int], int]) -> None:
        self._since = since

    async def before(self, ctx: RequestContext, candidates: Sequence[Candidate]) -> None:
        ctx.inflight = {c.worker_id: self._since(c.worker_id, c.load.reported_ms) for c in candidates}
