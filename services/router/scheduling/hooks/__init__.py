"""The hooks around a scheduling cycle, one plugin per file (as the Inference Extension's director
runs its PreRequest and PostResponse plugins around its scheduler):

  pre-cycle      inflight (requests sent since each worker's last load report), adapters_sent
                 (LoRA adapters sent each worker lately)
  post-cycle     adapters_sent (the send noted), provision (the prompt's blocks filed where they will
                 be), routed (the count by policy and worker)
  post-response  flow_accounting (batching windows and circuit breakers), prediction (the KV
                 directory's predictions the engines did not bear out)

Hooks runs each kind in order; the router's Stages assembles them (services/router/stages.py).
A new policy around placement is a new plugin here, not a branch in the router's stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router.scheduling.types import Candidate, PostCycle, PostResponse, PreCycle, RequestContext, Response


@dataclass(frozen=True, slots=True)
class Hooks:
    pre: Sequence[PreCycle] = ()
    post: Sequence[PostCycle] = ()
    response: Sequence[PostResponse] = ()

    async def before(self, ctx: RequestContext, candidates: Sequence[Candidate]) -> None:
        for h in self.pre:
            await h.before(ctx, candidates)

    def picked(self, ctx: RequestContext, worker: Candidate, candidates: Sequence[Candidate]) -> None:
        for h in self.post:
            h.picked(ctx, worker, candidates)

    def first_token(self, r: Response) -> None:
        for h in self.response:
            h.first_token(r)

    def succeeded(self, r: Response) -> None:
        for h in self.response:
            h.succeeded(r)

    def failed(self, r: Response) -> None:
        for h in self.response:
            h.failed(r)

    def served(self, r: Response) -> None:
        for h in self.response:
            h.served(r)

    def ended(self, r: Response) -> None:
        for h in self.response:
            h.ended(r)
