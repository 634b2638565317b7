"""Request-scoped values, set once per RPC by the metadata interceptor and read anywhere below it.

begin_request() is the one reading of a request's headers into them: the server interceptor calls
it with each call's metadata, and a servicer whose requests arrive as messages of one stream (the
router's ext_proc, which gets each HTTP request's headers in its first message) calls it with
those headers.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from contextvars import ContextVar

from gaas.contracts.headers import (  # noqa: F401 - the keys, read here; importable from here too
    AUTHORIZATION_HEADER, CALLER_HEADER, CLIENT_REQUEST_ID_HEADER, INGRESS_START_HEADER, PEER_ADDRESS_HEADER,
    REQUEST_ID_HEADER, TENANT_HEADER, WORKER_HEADER,
)
from gaas.contracts.identity import Caller, caller_from_xfcc
from gaas.contracts.ids import TenantId

# Longest client request id kept (longer ones are cut); only printable ASCII survives.
CLIENT_ID_MAX = 128

request_id_var: ContextVar[str] = ContextVar("gaas_request_id", default="")
tenant_var: ContextVar[str] = ContextVar("gaas_tenant", default="")
# The caller's Authorization value, as sent ("Bearer <key>"); only the router reads it.
authorization_var: ContextVar[str] = ContextVar("gaas_authorization", default="")
# The id the client gave its request (x-request-id, or the request_id field): logged beside GaaS's
# own id, never used in its place.
client_request_id_var: ContextVar[str] = ContextVar("gaas_client_request_id", default="")
# The raw x-forwarded-client-cert of the current call ("" when it did not come through a sidecar).
caller_var: ContextVar[str] = ContextVar("gaas_caller", default="")
# The address its connection came from, as the sidecar saw it ("" likewise).
peer_var: ContextVar[str] = ContextVar("gaas_peer", default="")
# The status code a servicer answered with inside its stream, the call itself ending OK
# (gaas.runtime.status.answer_in_stream); "" when none. The interceptor counts the call under it.
answered_var: ContextVar[str] = ContextVar("gaas_answered", default="")


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex


def sanitize_client_id(value: str) -> str:
    """A client-chosen id made safe to log: printable ASCII only, at most CLIENT_ID_MAX characters."""
    return "".join(c for c in value[: CLIENT_ID_MAX * 4] if " " < c < "\x7f")[:CLIENT_ID_MAX]


def begin_request(headers: Mapping[str, str], *, edge: bool) -> str:
    """Set the current request's id, client id, tenant and authorization from its headers (lower
    case keys: gRPC metadata, or the HTTP headers a stream's message carries); returns its id.

    edge: the headers come from outside the mesh (the router). The edge believes no GaaS header:
    it mints its own request id (a client must not choose ids that could collide with another
    request's) and keeps the caller's x-request-id only as client_request_id, for the logs; the
    tenant is set after authentication. Services behind the edge trust both, Envoy's x-request-id
    being the fallback so that access logs and service logs share the id.
    """
    client_id = sanitize_client_id(headers.get(CLIENT_REQUEST_ID_HEADER, ""))
    client_request_id_var.set(client_id)
    if edge:
        request_id = new_request_id()
        tenant_var.set("")
    else:
        request_id = headers.get(REQUEST_ID_HEADER, "") or client_id or new_request_id()
        tenant_var.set(headers.get(TENANT_HEADER, ""))
    request_id_var.set(request_id)
    authorization_var.set(headers.get(AUTHORIZATION_HEADER, ""))
    return request_id


def current_request_id() -> str:
    return request_id_var.get()


def current_tenant() -> TenantId:
    return TenantId(tenant_var.get())


def current_authorization() -> str:
    return authorization_var.get()


def current_caller() -> Caller | None:
    """The verified caller of the RPC being served (None when it did not come through a sidecar)."""
    caller = caller_from_xfcc(caller_var.get())
    return caller if caller is None else caller.at(peer_var.get())
