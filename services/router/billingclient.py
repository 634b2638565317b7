"""The router's calls to billing, through its sidecar: a tenant's own usage, for
`GET /v1/gaas/usage` and Inference.GetUsage (the tenant is the API key's, never the request's)."""

from __future__ import annotations

import logging

import grpc

from gaas.contracts import errors
from gaas.runtime import status
from gaas.v1 import billing_pb2, billing_pb2_grpc

log = logging.getLogger(__name__)

BILLING_TIMEOUT = 5.0


def usage_reader(stub: billing_pb2_grpc.BillingStub):
    """read(tenant, start_ms, end_ms, group_by) -> UsageReport; errors.Unavailable when billing
    does not answer (an argument billing refuses is errors.InvalidArgument, with its message)."""

    async def read(tenant: str, start_ms: int, end_ms: int, group_by: str) -> billing_pb2.UsageReport:
        request = billing_pb2.GetUsageRequest(tenant=tenant, start_unix_ms=start_ms, end_unix_ms=end_ms, group_by=group_by)
        try:
            return await stub.GetUsage(request, timeout=BILLING_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # billing's message without its details: the field it names is billing's, not the caller's
                raise errors.InvalidArgument(exc.details() or "invalid usage query") from None
            log.warning("cannot read %s's usage from billing: %s %s", tenant, exc.code().name, exc.details())
            raise status.from_peer(exc, "billing", passes=(), unanswered=status.ALL_CODES,
                                   message="usage cannot be read right now; retry shortly") from None

    return read
