"""The router's clients of control and billing: what the router's caller is told when the peer
fails (status.from_peer under each client's policy), and that the peer's text stays in the log."""

from __future__ import annotations

import grpc
import pytest

from gaas.contracts import errors
from services.router.billingclient import usage_reader
from services.router.controlclient import control_fetcher, key_lookup


def peer_error(code: grpc.StatusCode, details: str = "db at 10.0.0.5 refused"):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FailingStub:
    """A stub whose every call fails with one error."""

    def __init__(self, exc):
        self.exc = exc

    def __getattr__(self, name):
        async def call(request, timeout=None):
            raise self.exc

        return call


FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
            grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.parametrize("code", FAILURES)
async def test_any_failure_of_control_is_control_unreachable(code):
    with pytest.raises(errors.Unavailable) as fetched:
        await control_fetcher(FailingStub(peer_error(code)))()
    with pytest.raises(errors.Unavailable) as checked:
        await key_lookup(FailingStub(peer_error(code)))("sk-1")
    assert fetched.value.message == "the control plane is unreachable; retry shortly"
    assert checked.value.message == "cannot check the API key right now; retry shortly"


async def test_a_key_control_does_not_know_is_none():
    assert await key_lookup(FailingStub(peer_error(grpc.StatusCode.UNAUTHENTICATED)))("sk-1") is None


@pytest.mark.parametrize("code", FAILURES)
async def test_a_failure_of_billing_is_usage_unavailable(code):
    with pytest.raises(errors.Unavailable) as err:
        await usage_reader(FailingStub(peer_error(code)))("acme", 0, 0, "")
    assert err.value.message == "usage cannot be read right now; retry shortly"


async def test_billings_refusal_passes_on_with_its_message_only():
    refusal = peer_error(grpc.StatusCode.INVALID_ARGUMENT, "group_by must be model, day or key")
    with pytest.raises(errors.InvalidArgument) as err:
        await usage_reader(FailingStub(refusal))("acme", 0, 0, "week")
    assert err.value.message == "group_by must be model, day or key" and err.value.param is None
