"""A worker's HTTP/1.1 front: the OpenAI generations the ingress streams from this worker
(ingress.path: direct), as its sidecar forwards them here, each chunk of the answer one write to
the socket. gRPC would cost a message's machinery per token on this process's event loop (grpc.aio
spent about three times what a plain write does per streamed message, docs/benchmarks.md); the
native API's Generate and everything else a worker serves stay gRPC.

The request is what the ingress's transcoder made of the client's and the router's decision then
rewrote (gaas/metering/direct.py): POST /gaas.v1.OpenAI/Completions or ChatCompletions, its body
one gRPC-framed HttpBody holding a DirectGenerate. The answer is plain HTTP, which the ingress's
transcoder passes through untouched (it transcodes only a gRPC answer): Server-Sent Events or one
JSON body, chunked. A failure before the first byte is the status's HTTP code and its
google.rpc.Status as JSON, the body the transcoder makes of a failed call, so the ingress's error
filter gives both OpenAI's shape; with x-gaas-unreached when nothing of the request was done (the
ingress then tries the router's second choice). A failure after it is an error event in the stream
(gaas.openai.stream.respond); one that cannot be cuts the connection, so no client reads a short
answer as a whole one.

Only the worker's sidecar connects here (a Unix socket only the mesh's owner can enter, or a pod's
loopback), and it forwards only what the ingress sends (its RBAC); requests are bounded all the
same (MAX_REQUEST_BYTES).
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import httptools
from google.api import httpbody_pb2
from google.protobuf.message import DecodeError
from opentelemetry import propagate, trace

from gaas.contracts import errors
from gaas.contracts.headers import UNREACHED_HEADER
from gaas.runtime import status, telemetry
from gaas.runtime.interceptors import enter_call
from gaas.runtime.metrics import ServiceMetrics
from gaas.runtime.server import listen_plain

log = logging.getLogger(__name__)

# A request's body: one DirectGenerate (services/worker/direct.py's limit) and its framing.
MAX_REQUEST_BYTES = (64 << 20) + 1024
# gRPC's frame before a message: a compressed flag and the message's length (4 bytes, big-endian).
FRAME_PREFIX = 5

# The answer of a route: the HttpBody pieces of one generation (their content type, then data).
Answer = Callable[[httpbody_pb2.HttpBody], AsyncIterator[httpbody_pb2.HttpBody]]


@dataclass(slots=True)
class _Request:
    method: bytes = b""
    path: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    too_large: bool = False
    keep_alive: bool = True


class HttpFront:
    """Serves routes (path -> Answer) over HTTP/1.1 at a Unix socket or a host:port, each request
    with the context a gRPC call gets from the server interceptor (gaas.runtime.interceptors), its
    metrics under the route's method name, and a server span when tracing is on."""

    def __init__(self, routes: Mapping[str, Answer], metrics: ServiceMetrics, *, named_as: str = "",
                 tracer_provider: trace.TracerProvider | None = None) -> None:
        self.routes = dict(routes)
        self.metrics = metrics
        self.named_as = named_as
        self.tracer = telemetry.plain_tracer(tracer_provider, __name__)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()

    async def start(self, listen: str) -> None:
        """Listen at listen: unix:/path (a leftover socket file replaced, a live one refused) or host:port."""
        self._server = await listen_plain(lambda: _Connection(self), listen)
        log.info("HTTP front listening on %s", listen)

    async def stop(self, grace: float) -> None:
        """Take no new connection; let the requests running finish for grace seconds, then cut them."""
        if self._server is not None:
            self._server.close()
        for c in list(self._connections):
            c.close_when_idle()
        running = [c.task for c in self._connections if c.task is not None]
        if running:
            await asyncio.wait(running, timeout=grace)
        for c in list(self._connections):
            c.abort()


class _Connection(asyncio.Protocol):
    """One connection from the sidecar: its requests one after another (keep-alive)."""

    def __init__(self, front: HttpFront) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.request = _Request()
        self.pending: deque[_Request] = deque()
        self.task: asyncio.Task | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        # No request after the one running (stopping, or the client asked); the connection gone.
        self.closing = False
        self.lost = False

    # asyncio's side

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.front._connections.add(self)

    def connection_lost(self, exc) -> None:
        self.front._connections.discard(self)
        self.closing = self.lost = True
        self.writable.set()
        if self.task is not None:
            self.task.cancel()  # the client went away: the handler hears it as a cancellation

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not served here")

    # httptools' side

    def on_message_begin(self) -> None:
        self.request = _Request()

    def on_url(self, url: bytes) -> None:
        self.request.path += url.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.request.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_body(self, body: bytes) -> None:
        r = self.request
        if r.too_large or len(r.body) + len(body) > MAX_REQUEST_BYTES:
            r.too_large = True
            r.body = bytearray()
        else:
            r.body += body

    def on_message_complete(self) -> None:
        r = self.request
        r.method = self.parser.get_method()
        r.keep_alive = self.parser.should_keep_alive()
        self.pending.append(r)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve_pending())

    # Serving

    async def _serve_pending(self) -> None:
        try:
            while self.pending and not self.closing:
                r = self.pending.popleft()
                await self._serve(r)
                if not r.keep_alive or self.closing:
                    self.closing = True
                    self.transport.close()
        finally:
            self.task = None

    async def _serve(self, r: _Request) -> None:
        # (the metrics' label: a route's method name, never an arbitrary path)
        method = r.path.rsplit("/", 1)[-1] if r.path in self.front.routes else "unknown"
        started, code = time.perf_counter(), "OK"
        try:
            answer = self.front.routes.get(r.path)
            if r.method != b"POST" or answer is None:
                code = "NOT_FOUND"
                self._write_error(errors.NotFound(f"no such method here: {r.method.decode()} {r.path}"))
                return
            if r.too_large:
                code = "RESOURCE_EXHAUSTED"
                self._refuse(413, f"the request is larger than {MAX_REQUEST_BYTES} bytes")
                return
            code = await self._answer(r, answer)
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        finally:
            self.front.metrics.rpcs.labels(method, code).inc()
            self.front.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    async def _answer(self, r: _Request, answer: Answer) -> str:
        """Serve r, returning the status it ended with (its name, as the gRPC metrics count it)."""
        tracer = self.front.tracer
        if tracer is None:
            return await self._stream(r, answer)
        with tracer.start_as_current_span(r.path, context=propagate.extract(r.headers), kind=trace.SpanKind.SERVER):
            return await self._stream(r, answer)

    async def _stream(self, r: _Request, answer: Answer) -> str:
        pieces = None
        try:
            enter_call(r.headers, edge=False, named_as=self.front.named_as)
            pieces = answer(_http_body(r.body))
            first = await anext(pieces)
        except StopAsyncIteration:
            first = None
        except Exception as exc:  # noqa: BLE001 - answered as its status, before any byte of the answer
            if pieces is not None:
                await pieces.aclose()
            err = status.translate(exc)
            if err is None:
                raise
            status.log_answer(err)
            self._write_error(err)
            return err.code
        write = self.transport.write
        content_type = first.content_type if first is not None else "application/json"
        write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % content_type.encode())
        try:
            if first is not None:
                write(_chunk(first.data))
                async for piece in pieces:
                    if not self.writable.is_set():
                        await self.writable.wait()
                    if self.lost:
                        break
                    write(_chunk(piece.data))
        except Exception as exc:  # noqa: BLE001 - after the first byte a status cannot be sent: cut
            err = status.translate(exc)
            if err is None:
                raise
            log.warning("an answer failed after its first byte (%s: %s); its connection is cut", err.code, err.message)
            self.abort()
            return err.code
        finally:
            if first is not None:
                await pieces.aclose()
        write(b"0\r\n\r\n")
        return "OK"

    def _write_error(self, err: errors.GaasError) -> None:
        body = status.status_json(err).encode()
        extra = b"%s: 1\r\n" % UNREACHED_HEADER.encode() if err.untaken else b""
        self.transport.write(_head(err.info.http_status, len(body), extra) + body)

    def _refuse(self, code: int, message: str) -> None:
        """Answer what cannot be read as a request, and close the connection."""
        if self.closing or self.transport is None:
            return
        body = status.status_json(errors.InvalidArgument(message)).encode()
        self.transport.write(_head(code, len(body), b"connection: close\r\n") + body)
        self.closing = True
        self.transport.close()

    def close_when_idle(self) -> None:
        """Stopping: serve no request after the one running (close now if none is)."""
        self.closing = True
        if self.task is None and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()


def _http_body(body: bytearray) -> httpbody_pb2.HttpBody:
    """The HttpBody in a gRPC-framed request body (one uncompressed message)."""
    if len(body) < FRAME_PREFIX or body[0] != 0 or int.from_bytes(body[1:FRAME_PREFIX], "big") != len(body) - FRAME_PREFIX:
        raise errors.InvalidArgument("the request body is not one uncompressed gRPC message")
    try:
        return httpbody_pb2.HttpBody.FromString(bytes(body[FRAME_PREFIX:]))
    except DecodeError:
        raise errors.InvalidArgument("the request body is not an HttpBody") from None


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _head(code: int, length: int, extra: bytes = b"") -> bytes:
    try:
        phrase = http.HTTPStatus(code).phrase
    except ValueError:
        phrase = "Error"
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (
        code, phrase.encode(), length, extra)

