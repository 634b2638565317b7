"""Post-response: a finished request's cached tokens checked against the blocks the KV directory
said its worker held (services/router/outcomes.py counts and logs a shortfall)."""

from __future__ import annotations

from collections.abc import Callable

from services.router.scheduling.types import PostResponse, Response, WorkerId


class PredictionCheck(PostResponse):
    name = "prediction"

    def __init__(self, check: Callable[[WorkerId, int, int, int], None]) -> None:
        self._check = check

    def served(self, r: Response) -> None:
        self._check(r.worker, r.confirmed_blocks, r.block_size, r.cached_tokens)
