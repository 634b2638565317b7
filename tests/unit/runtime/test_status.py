"""One mapping of a peer's failure (status.from_peer) and one reading of a request's headers
(context.begin_request)."""

from __future__ import annotations

import contextvars

import grpc
import pytest

from gaas.contracts import errors
from gaas.runtime import status
from gaas.runtime.context import (
    authorization_var,
    begin_request,
    client_request_id_var,
    request_id_var,
    tenant_var,
)


def peer_error(code: grpc.StatusCode, details: str = "the peer's text", err: errors.GaasError | None = None):
    trailing = grpc.aio.Metadata()
    if err is not None:
        trailing = grpc.aio.Metadata((status.DETAILS_KEY, status.status_details(err)))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


@pytest.mark.parametrize("code, kind, message", [
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable, "control did not answer; retry shortly"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.Unavailable, "control did not answer; retry shortly"),
    (grpc.StatusCode.INTERNAL, errors.Internal, "internal error (request id req-1)"),
    (grpc.StatusCode.UNKNOWN, errors.Internal, "internal error (request id req-1)"),
    (grpc.StatusCode.DATA_LOSS, errors.Internal, "internal error (request id req-1)"),
    (grpc.StatusCode.NOT_FOUND, errors.NotFound, "the peer's text"),
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument, "the peer's text"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted, "the peer's text"),
])
def test_a_peers_failure_by_default(code, kind, message):
    token = request_id_var.set("req-1")
    try:
        err = status.from_peer(peer_error(code), "control")
    finally:
        request_id_var.reset(token)
    assert type(err) is kind and err.message.startswith(message)


def test_a_peers_own_answer_keeps_its_details():
    sent = errors.ResourceExhausted("over quota", param="max_tokens", retry_after=3.0)
    err = status.from_peer(peer_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "over quota", sent), "worker")
    assert isinstance(err, errors.ResourceExhausted) and (err.param, err.retry_after) == ("max_tokens", 3.0)


def test_each_caller_states_its_own_policy():
    down, refused, broken = (peer_error(c) for c in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INTERNAL))
    # The router's clients of control: any failure of control is control not answering.
    control = dict(passes=(), unanswered=status.ALL_CODES, message="the control plane is unreachable")
    assert all(status.from_peer(e, "control", **control).message == "the control plane is unreachable"
               for e in (down, refused, broken))
    # The operator's CLI: what its peer answered, all but silence.
    cli = dict(passes=status.ALL_CODES - status.UNANSWERED, message="control does not answer: is the mesh up?")
    assert status.from_peer(down, "control", **cli).message == "control does not answer: is the mesh up?"
    assert isinstance(status.from_peer(refused, "control", **cli), errors.PermissionDenied)
    assert status.from_peer(broken, "control", **cli).message == "the peer's text"
    # A handler that left a peer's failure to the interceptor: none of the peer's words pass.
    assert isinstance(status.from_peer(refused, "a peer", passes=(), request_id="req-9"), errors.Internal)
    # The router's workers (services/router/relay.py): a cancelled call is a worker gone.
    worker = dict(passes=status.PEER_ANSWERS - {"CANCELLED"}, unanswered=status.UNANSWERED | {"CANCELLED"},
                  message="no worker could take the request right now; retry shortly")
    assert isinstance(status.from_peer(peer_error(grpc.StatusCode.CANCELLED), "worker", **worker), errors.Unavailable)


def test_the_code_sets_cover_every_code_once():
    assert status.UNANSWERED | status.PEER_FAILED | status.PEER_ANSWERS == status.ALL_CODES
    assert not (status.UNANSWERED & status.PEER_FAILED) and not (status.PEER_ANSWERS & status.PEER_FAILED)
    assert "OK" not in status.ALL_CODES


def test_cancellations_and_aborts_pass_translate_untouched():
    import asyncio

    assert status.translate(asyncio.CancelledError()) is None
    assert status.translate(GeneratorExit()) is None
    err = errors.NotFound("x")
    assert status.translate(err) is err


def test_begin_request_inside_the_mesh_and_at_its_edge():
    contextvars.copy_context().run(_begin_request_inside_the_mesh_and_at_its_edge)


def _begin_request_inside_the_mesh_and_at_its_edge():
    headers = {"x-gaas-request-id": "req-7", "x-gaas-tenant": "acme", "x-request-id": "mine\n1",
               "authorization": "Bearer k"}
    assert begin_request(headers, edge=False) == "req-7"
    assert (request_id_var.get(), tenant_var.get(), client_request_id_var.get(), authorization_var.get()) == (
        "req-7", "acme", "mine1", "Bearer k")
    rid = begin_request(headers, edge=True)
    assert rid.startswith("req-") and rid != "req-7" and request_id_var.get() == rid and tenant_var.get() == ""
    assert client_request_id_var.get() == "mine1" and authorization_var.get() == "Bearer k"
    assert begin_request({"x-request-id": "c-2"}, edge=False) == "c-2", "the client's id when the mesh gave none"
