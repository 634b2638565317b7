"""Pre- and post-cycle: the LoRA adapters this router sent each worker lately, which its load report
may not list yet (it says what the engine holds at most a second late), so the requests right after
an adapter's first one go where it is being loaded instead of loading it on another worker too."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from services.router.scheduling.types import Candidate, PostCycle, PreCycle, RequestContext, WorkerId

# How long a send counts as the adapter being on that worker: past it, the worker's reports say.
SENT_SECONDS = 5.0


class AdaptersSent(PreCycle, PostCycle):
    name = "adapters_sent"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # worker -> adapter -> when this router last sent it a request with it.
        self._sent: dict[WorkerId, dict[str, float]] = {}

    async def before(self, ctx: RequestContext, candidates: Sequence[Candidate]) -> None:
        if not ctx.adapter or not self._sent:
            return
        since = self._clock() - SENT_SECONDS
        ctx.adapters_sent = {c.worker_id: frozenset(a for a, t in sent.items() if t >= since)
                             for c in candidates if (sent := self._sent.get(c.worker_id))}

    def picked(self, ctx: RequestContext, worker: Candidate, candidates: Sequence[Candidate]) -> None:
        if not ctx.adapter:
            return
        now = self._clock()
        sent = self._sent.setdefault(worker.worker_id, {})
        sent[ctx.adapter] = now
        if len(sent) > 64:  # (a worker asked for many adapters: the old sends say nothing now)
            for a in [a for a, t in sent.items() if t < now - SENT_SECONDS]:
                del sent[a]
