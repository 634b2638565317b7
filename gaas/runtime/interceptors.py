"""gRPC interceptors: request context in (server), request context out (client), RPC metrics.

The server interceptor is the one place that reads GaaS metadata: it sets the request id and
tenant ContextVars for the handler, so servicers never parse metadata themselves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from gaas.runtime.context import (
    AUTHORIZATION_HEADER,
    REQUEST_ID_HEADER,
    TENANT_HEADER,
    authorization_var,
    new_request_id,
    request_id_var,
    tenant_var,
)
from gaas.runtime.metrics import ServiceMetrics


def _metadata_value(metadata, key: str) -> str:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return ""


def _status_of(exc: BaseException | None, context) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    code = context.code()
    if code is not None:
        return code.name
    return grpc.StatusCode.UNKNOWN.name if exc is not None else grpc.StatusCode.OK.name


class ServerContextInterceptor(grpc.aio.ServerInterceptor):
    """Sets request_id_var / tenant_var from metadata and records per-method metrics.

    trust_tenant: whether x-gaas-tenant from the caller is believed. Only services behind the
    router (which sets it after authentication) trust it; the router itself never does.
    """

    def __init__(self, metrics: ServiceMetrics, *, trust_tenant: bool) -> None:
        self._metrics = metrics
        self._trust_tenant = trust_tenant

    def _enter(self, context) -> None:
        md = context.invocation_metadata()
        # Envoy's x-request-id is the fallback, so access logs and service logs share the id.
        request_id_var.set(
            _metadata_value(md, REQUEST_ID_HEADER) or _metadata_value(md, "x-request-id") or new_request_id()
        )
        tenant_var.set(_metadata_value(md, TENANT_HEADER) if self._trust_tenant else "")
        authorization_var.set(_metadata_value(md, AUTHORIZATION_HEADER))

    def _done(self, method: str, started: float, exc: BaseException | None, context) -> None:
        self._metrics.rpcs.labels(method, _status_of(exc, context)).inc()
        self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        enter, done = self._enter, self._done

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                enter(context)
                started, exc = time.perf_counter(), None
                try:
                    return await inner(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    done(method, started, exc, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                enter(context)
                started, exc = time.perf_counter(), None
                try:
                    async for item in inner(request, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    done(method, started, exc, context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            inner = handler.stream_unary

            async def stream_unary(request_iterator, context):
                enter(context)
                started, exc = time.perf_counter(), None
                try:
                    return await inner(request_iterator, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    done(method, started, exc, context)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        # Bidirectional streams are not wrapped (none of GaaS's APIs uses one yet).
        return handler


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    md = grpc.aio.Metadata(*(details.metadata or ()))
    if (rid := request_id_var.get()) and REQUEST_ID_HEADER not in md:
        md[REQUEST_ID_HEADER] = rid
    if (tenant := tenant_var.get()) and TENANT_HEADER not in md:
        md[TENANT_HEADER] = tenant
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, md, details.credentials, details.wait_for_ready
    )


class _UnaryUnaryContext(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _UnaryStreamContext(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _StreamUnaryContext(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_context(client_call_details), request_iterator)


def client_context_interceptors() -> list:
    """Interceptors carrying the current request id and tenant onto outgoing calls.

    One object per call kind: grpc.aio files each interceptor under the first kind it implements
    only, so a single class implementing all three would never see streaming calls.
    """
    return [_UnaryUnaryContext(), _UnaryStreamContext(), _StreamUnaryContext()]
