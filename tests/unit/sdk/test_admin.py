"""The operator's calls: a service that does not answer is named with its address; whatever else
it answered is the operator's to read (status.from_peer with the CLI's policy)."""

from __future__ import annotations

import grpc
import pytest

from gaas.contracts import errors
from gaas.runtime import status
from gaas.sdk.admin import Admin


class Failed(grpc.RpcError):
    """A blocking call's failure, as grpc raises it."""

    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


class FailingStub:
    def __init__(self, exc):
        self.exc = exc

    def __getattr__(self, name):
        def call(request, timeout=None):
            raise self.exc

        return call


def admin_failing_with(exc) -> Admin:
    admin = Admin.__new__(Admin)  # no channel: the stub fails before any would be used
    admin.address, admin._stub = "127.0.0.1:7001", FailingStub(exc)
    return admin


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_service_that_does_not_answer_is_named_with_its_address(code):
    with pytest.raises(errors.Unavailable) as err:
        admin_failing_with(Failed(code, "connect failed"))._call("ListTenants", None)
    assert err.value.message == "the control plane at 127.0.0.1:7001 does not answer: is the mesh up?"


def test_what_the_service_answered_reaches_the_operator_with_its_details():
    sent = errors.NotFound("no tenant 'acme'", param="tenant")
    exc = Failed(grpc.StatusCode.NOT_FOUND, sent.message, ((status.DETAILS_KEY, status.status_details(sent)),))
    with pytest.raises(errors.NotFound) as err:
        admin_failing_with(exc)._call("GetTenant", None)
    assert (err.value.message, err.value.param) == ("no tenant 'acme'", "tenant")
    with pytest.raises(errors.Internal) as err:
        admin_failing_with(Failed(grpc.StatusCode.INTERNAL, "internal error (request id req-1)"))._call("X", None)
    assert err.value.message == "internal error (request id req-1)"
