"""gaas.v1.Billing: protobuf <-> ledger."""

from __future__ import annotations

from gaas import errors
from gaas.v1 import billing_pb2 as pb
from gaas.v1 import billing_pb2_grpc
from services.billing.ledger import Ledger


class BillingServicer(billing_pb2_grpc.BillingServicer):
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    async def GetUsage(self, request: pb.GetUsageRequest, context) -> pb.UsageSummary:
        if not request.tenant:
            raise errors.InvalidArgument("tenant is required", param="tenant")
        if request.end_unix_ms and request.end_unix_ms <= request.start_unix_ms:
            raise errors.InvalidArgument("end_unix_ms must be after start_unix_ms", param="end_unix_ms")
        t = await self._ledger.totals(request.tenant, request.start_unix_ms, request.end_unix_ms)
        return pb.UsageSummary(
            tenant=t.tenant,
            requests=t.requests,
            prompt_tokens=t.prompt_tokens,
            cached_tokens=t.cached_tokens,
            completion_tokens=t.completion_tokens,
        )
