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

request_id_var: ContextVar[str] = ContextVar("gaas_request_id", default="")
tenant_var: ContextVar[str] = ContextVar("gaas_tenant", default="")


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex


def current_request_id() -> str:
    return request_id_var.get()


def current_tenant() -> TenantId:
    return TenantId(tenant_var.get())
