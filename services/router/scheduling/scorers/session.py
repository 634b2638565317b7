"""Session affinity: 1 for the worker that served the session's last turn (its context's blocks
are likely still in that engine's cache, even when the directory has not heard of them yet), 0
for the others and for requests that are not session turns. Load filters still have the last
word: a saturated worker is filtered out before scoring."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, RequestContext, Scorer


@plugin("scorer")
class SessionScorer(Scorer):
    name = "session"

    def score(self, ctx: RequestContext, c: Candidate) -> float:
        return 1.0 if ctx.session_worker and c.worker_id == ctx.session_worker else 0.0
