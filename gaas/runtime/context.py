"""Request-scoped values, set once per RPC by the metadata interceptor and read anywhere below it."""

from __future__ import annotations

import uuid
from contextvars import ContextVar
from typing import NewType

TenantId = NewType("TenantId", str)

# Metadata keys (lower case, as gRPC delivers them).
REQUEST_ID_HEADER = "x-gaas-request-id"
TENANT_HEADER = "x-gaas-tenant"
WORKER_HEADER = "x-gaas-worker"
AUTHORIZATION_HEADER = "authorization"

request_id_var: ContextVar[str] = ContextVar("gaas_request_id", default="")
tenant_var: ContextVar[str] = ContextVar("gaas_tenant", default="")
# The caller's Authorization value, as sent ("Bearer <key>"); only the router reads it.
authorization_var: ContextVar[str] = ContextVar("gaas_authorization", default="")


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex


def current_request_id() -> str:
    return request_id_var.get()


def current_tenant() -> TenantId:
    return TenantId(tenant_var.get())


def current_authorization() -> str:
    return authorization_var.get()
