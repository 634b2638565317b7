"""Post-cycle: the prompt's blocks filed in the KV directory under the picked worker, before its
engine says so, so that the next request with the same prefix finds them at once. With one
candidate nothing was decided by it (the engine's own events tell the directory)."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.kvclient import KVDirectoryClient
from services.router.scheduling.types import Candidate, PostCycle, RequestContext


class Provision(PostCycle):
    name = "provision"

    def __init__(self, kv: KVDirectoryClient) -> None:
        self._kv = kv

    def picked(self, ctx: RequestContext, worker: Candidate, candidates: Sequence[Candidate]) -> None:
        if ctx.block_hashes and len(candidates) > 1:
            self._kv.provision(worker.worker_id, ctx.block_hashes, ctx.cache_owner, max(ctx.prefix.values(), default=0))
