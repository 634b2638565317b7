"""gRPC interceptors: request context in (server), request context out (client), RPC metrics,
and the one place a process turns its exceptions into gRPC statuses.

The server interceptor is the one place that reads GaaS metadata: it sets the request id and
tenant ContextVars for the handler, so servicers never parse metadata themselves. It also ends
every call whose handler raised: a GaasError with its own status (gaas.runtime.status), anything
else as INTERNAL with a short message and the request id (the traceback goes to the log), and a
request message that does not parse as INVALID_ARGUMENT instead of grpc's own INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from gaas.contracts import errors
from gaas.runtime import status
from gaas.runtime.context import (
    AUTHORIZATION_HEADER,
    CALLER_HEADER,
    CLIENT_REQUEST_ID_HEADER,
    REQUEST_ID_HEADER,
    TENANT_HEADER,
    authorization_var,
    caller_var,
    client_request_id_var,
    new_request_id,
    request_id_var,
    sanitize_client_id,
    tenant_var,
)
from gaas.runtime.metrics import ServiceMetrics

log = logging.getLogger(__name__)


def _metadata_value(metadata, key: str) -> str:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else v.decode("utf-8", "replace")
    return ""


def _status_of(exc: BaseException | None, context) -> str:
    # A stream closed under its handler (GeneratorExit: the client went away between messages)
    # was cancelled, as much as one cancelled while it waited.
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name
    code = context.code()
    if code is not None:
        return code.name
    return grpc.StatusCode.UNKNOWN.name if exc is not None else grpc.StatusCode.OK.name


class _Malformed:
    """Stands for a request message that did not deserialize."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _tolerant(deserializer: Callable | None) -> Callable | None:
    """A deserializer that returns _Malformed instead of raising (grpc would answer INTERNAL)."""
    if deserializer is None:
        return None
    type_name = getattr(getattr(deserializer, "__self__", None), "__name__", "request")

    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except Exception:  # noqa: BLE001 - any parse failure is the caller's malformed message
            return _Malformed(type_name)

    return deserialize


def _check_parsed(request) -> None:
    if isinstance(request, _Malformed):
        raise errors.InvalidArgument(
            f"the request message is not a valid {request.type_name}: check that the client uses GaaS's .proto "
            "files (gaas.v1) and sends text fields as valid UTF-8"
        )


async def _tolerant_iterator(request_iterator):
    async for item in request_iterator:
        _check_parsed(item)
        yield item


def translate(exc: BaseException) -> errors.GaasError | None:
    """The GaasError a handler's exception answers with; None for those that must pass untouched
    (an abort already under way, a cancellation)."""
    if isinstance(exc, errors.GaasError):
        return exc
    if isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError)) or not isinstance(exc, Exception):
        return None
    if isinstance(exc, grpc.RpcError):
        # A peer's failure that the handler did not deal with: its text is the peer's business.
        peer = status.from_rpc(exc)
        if peer.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            log.warning("a peer did not answer: %s %s", peer.code, peer.message)
            return errors.Unavailable("a service this call needs did not answer; retry shortly")
    log.error("unexpected %s: %s", type(exc).__name__, exc, exc_info=exc)
    return errors.Internal(errors.internal_message(request_id_var.get()))


async def _answer(context, exc: BaseException) -> None:
    """End the call for exc (re-raising what must pass); never returns normally."""
    err = translate(exc)
    if err is None:
        raise exc
    if err.code not in ("INTERNAL", "UNKNOWN", "UNAVAILABLE"):
        log.info("%s: %s", err.code, err.message)
    await status.abort(context, err)


class ServerContextInterceptor(grpc.aio.ServerInterceptor):
    """Sets the request context from metadata, records per-method metrics and answers failures.

    edge: whether this service is the mesh's edge (the router). The edge believes no GaaS metadata
    from its callers: it mints its own request id (a client must not choose ids that could collide
    with another request's) and keeps the caller's x-request-id only as client_request_id, for the
    logs; the tenant is set after authentication. Services behind the edge trust both.
    """

    def __init__(self, metrics: ServiceMetrics, *, edge: bool) -> None:
        self._metrics = metrics
        self._edge = edge

    def _enter(self, context) -> None:
        md = context.invocation_metadata()
        client_id = sanitize_client_id(_metadata_value(md, CLIENT_REQUEST_ID_HEADER))
        client_request_id_var.set(client_id)
        if self._edge:
            request_id_var.set(new_request_id())
            tenant_var.set("")
        else:
            # Envoy's x-request-id is the fallback, so access logs and service logs share the id.
            request_id_var.set(_metadata_value(md, REQUEST_ID_HEADER) or client_id or new_request_id())
            tenant_var.set(_metadata_value(md, TENANT_HEADER))
        authorization_var.set(_metadata_value(md, AUTHORIZATION_HEADER))
        caller_var.set(_metadata_value(md, CALLER_HEADER))

    def _done(self, method: str, started: float, exc: BaseException | None, context) -> None:
        self._metrics.rpcs.labels(method, _status_of(exc, context)).inc()
        self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        enter, done = self._enter, self._done
        deserializer = _tolerant(handler.request_deserializer)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                enter(context)
                started, exc = time.perf_counter(), None
                try:
                    _check_parsed(request)
                    return await inner(request, context)
                except BaseException as e:
                    exc = e
                    await _answer(context, e)
                finally:
                    done(method, started, exc, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                enter(context)
                started, exc = time.perf_counter(), None
                try:
                    _check_parsed(request)
                    async for item in inner(request, context):
                        yield item
                except BaseException as e:
                    exc = e
                    await _answer(context, e)
                finally:
                    done(method, started, exc, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, handler.response_serializer)
        if handler.stream_unary:
            inner = handler.stream_unary

            async def stream_unary(request_iterator, context):
                enter(context)
                started, exc = time.perf_counter(), None
                try:
                    return await inner(_tolerant_iterator(request_iterator), context)
                except BaseException as e:
                    exc = e
                    await _answer(context, e)
                finally:
                    done(method, started, exc, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, handler.response_serializer)
        # Bidirectional streams (server reflection) are not wrapped.
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
