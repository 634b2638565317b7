"""gRPC interceptors: request context in (server), request context out (client), RPC metrics,
and the one place a process turns its exceptions into gRPC statuses.

The server interceptor wraps every call, of all four kinds (unary or streamed request, unary or
streamed answer), the same way. It is the one place that reads GaaS metadata: it sets the request
id and tenant ContextVars for the handler (gaas.runtime.context.begin_request), so servicers never
parse metadata themselves. It counts every call and its duration by method and status code. And it
ends every call whose handler raised: a GaasError with its own status (gaas.runtime.status), a
peer's failure as status.translate says, anything else as INTERNAL with a short message and the
request id (the traceback goes to the log), and a request message that does not parse as
INVALID_ARGUMENT instead of grpc's own INTERNAL.

A servicer that must answer a failure inside its stream rather than as the call's status calls
gaas.runtime.status.answer_in_stream(exc): the failure is logged as here, and counted here under
its code though the call ends OK. One whose requests arrive as messages of its stream (the
router's ext_proc: each HTTP request's headers come in its first message) takes their context
with gaas.runtime.context.begin_request(headers, edge=...).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc

from gaas.contracts import errors
from gaas.runtime import status
from gaas.runtime.context import (
    CALLER_HEADER,
    PEER_ADDRESS_HEADER,
    REQUEST_ID_HEADER,
    TENANT_HEADER,
    WORKER_HEADER,
    answered_var,
    begin_request,
    caller_var,
    peer_var,
    request_id_var,
    tenant_var,
)
from gaas.runtime.metrics import ServiceMetrics


def _headers(metadata) -> dict[str, str]:
    """A call's text metadata as a dict (the first value of a repeated key; binary "-bin" keys,
    none of which carries request context, left out)."""
    out: dict[str, str] = {}
    for k, v in metadata or ():
        if isinstance(v, str):
            out.setdefault(k, v)
    return out


def _status_of(exc: BaseException | None, context) -> str:
    # A stream closed under its handler (GeneratorExit: the client went away between messages)
    # was cancelled, as much as one cancelled while it waited.
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name
    code = context.code()
    if code is not None:
        return code.name
    if exc is not None:
        return grpc.StatusCode.UNKNOWN.name
    # A failure the servicer answered inside its stream (status.answer_in_stream).
    return answered_var.get() or grpc.StatusCode.OK.name


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


def malformed(type_name: str) -> errors.InvalidArgument:
    """What a caller is told of a request message that does not parse as type_name."""
    return errors.InvalidArgument(
        f"the request message is not a valid {type_name}: check that the client uses GaaS's .proto "
        "files (gaas.v1) and sends text fields (and the headers the ingress puts in them) as valid UTF-8"
    )


def _check_parsed(request) -> None:
    if isinstance(request, _Malformed):
        raise malformed(request.type_name)


async def _tolerant_iterator(request_iterator) -> AsyncIterator:
    async for item in request_iterator:
        _check_parsed(item)
        yield item


async def _answer(context, exc: BaseException) -> None:
    """End the call for exc (re-raising what must pass); never returns normally."""
    err = status.translate(exc)
    if err is None:
        raise exc
    status.log_answer(err)
    await status.abort(context, err)


class NotNamed(errors.Unavailable):
    """A call reached a worker its x-gaas-worker does not name: an Envoy that had not yet heard
    that the named worker joined (or left) sent it to any worker. Nothing of it was done: the hop
    before may send it on (to the next it names, or back to a router)."""

    untaken = True


def enter_call(md: dict[str, str], *, edge: bool, named_as: str = "") -> None:
    """A call's context from its headers (lower-case keys: gRPC metadata or HTTP headers), as every
    server takes it (the interceptor below; a worker's HTTP front, services/worker/http.py): the
    request's id and tenant, who called from where; a call whose x-gaas-worker names only others
    than named_as is refused untaken (NotNamed)."""
    begin_request(md, edge=edge)
    caller_var.set(md.get(CALLER_HEADER, ""))
    peer_var.set(md.get(PEER_ADDRESS_HEADER, ""))
    answered_var.set("")
    if named_as and (named := md.get(WORKER_HEADER)) and named_as not in named.split(","):
        raise NotNamed(f"no worker chosen for this request could take it ({named} did not answer; it reached "
                       f"{named_as}, which serves only what is sent to it); retry shortly")


class ServerContextInterceptor(grpc.aio.ServerInterceptor):
    """Sets the request context from metadata, records per-method metrics and answers failures,
    for every kind of call.

    edge: whether this service is the mesh's edge (the router), which believes no GaaS metadata
    from its callers (see gaas.runtime.context.begin_request). named_as: a worker's own address; a
    call whose x-gaas-worker names only others is refused untaken (NotNamed).
    """

    def __init__(self, metrics: ServiceMetrics, *, edge: bool, named_as: str = "") -> None:
        self._metrics = metrics
        self._edge = edge
        self._named_as = named_as
        # Each method's handler wrapped once (a service's handlers are the same object at every
        # call), with its metrics' children: not built again for every call.
        self._wrapped: dict[str, tuple[object, object]] = {}

    def _enter(self, context) -> None:
        enter_call(_headers(context.invocation_metadata()), edge=self._edge, named_as=self._named_as)

    def _done(self, method: str, started: float, exc: BaseException | None, context) -> None:
        self._metrics.rpcs.labels(method, _status_of(exc, context)).inc()
        self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    @contextlib.asynccontextmanager
    async def _serving(self, method: str, context):
        """Around one call's handler: its context set, its failure answered, its metrics recorded."""
        started, exc = time.perf_counter(), None
        try:
            self._enter(context)
            yield
        except BaseException as e:
            exc = e
            await _answer(context, e)
        finally:
            self._done(method, started, exc, context)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, details.method.rsplit("/", 1)[-1])
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, method: str):
        """handler, served inside _serving."""
        serving = self._serving
        deserializer, serializer = _tolerant(handler.request_deserializer), handler.response_serializer

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                async with serving(method, context):
                    _check_parsed(request)
                    return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
        if handler.unary_stream:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                async with serving(method, context):
                    _check_parsed(request)
                    async for item in inner(request, context):
                        yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
        if handler.stream_unary:
            inner = handler.stream_unary

            async def stream_unary(request_iterator, context):
                async with serving(method, context):
                    return await inner(_tolerant_iterator(request_iterator), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, serializer)
        if handler.stream_stream:
            inner = handler.stream_stream

            async def stream_stream(request_iterator, context):
                async with serving(method, context):
                    async for item in inner(_tolerant_iterator(request_iterator), context):
                        yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, serializer)
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
