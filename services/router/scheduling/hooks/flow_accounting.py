"""Post-response: what the flow learns from each response (services/router/flow.py): the worker's
time to its first token for its circuit breaker and, against the tier's target, its batching
window; failures for the breaker (a busy answer shrinks the window instead); and the request's end,
which gives its room in the window to the next waiter."""

from __future__ import annotations

from gaas.contracts.qos import BATCH
from services.router.flow import Flow
from services.router.scheduling.types import PostResponse, Response


class FlowAccounting(PostResponse):
    name = "flow"

    def __init__(self, flow: Flow) -> None:
        self._flow = flow

    def first_token(self, r: Response) -> None:
        self._flow.first_token(r.worker, r.tier, r.ttft_ms, r.seen_ms, r.work)

    def succeeded(self, r: Response) -> None:
        self._flow.succeeded(r.worker)

    def failed(self, r: Response) -> None:
        self._flow.failed(r.worker, r.code, r.detail)

    def ended(self, r: Response) -> None:
        self._flow.finished(r.worker, batch=r.tier == BATCH)
