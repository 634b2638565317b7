"""The ingress's decision calls (Envoy's external processing, extproc.py) as the router's sidecar
forwards them here: the same gRPC method over HTTP/1.1, each ProcessingRequest read as its frame
arrives and each ProcessingResponse written as one chunk, the call's status in the trailers. The
sidecar still speaks gRPC to the ingress; only its last hop, to this process, is HTTP/1.1 (its
local_http cluster, trailers on). grpc.aio's machinery per call and message cost about three times
the CPU of this path for the same call (docs/benchmarks.md), and a decision is one call of a few
messages per request.

A connection carries one call at a time: the next once the ingress has ended its side of the last
(a call whose side it reset instead, the sidecar cannot finish here, and closes the connection).
Only the router's sidecar connects (a Unix socket only the mesh's owner can enter, or a pod's
loopback), and a call's messages are bounded all the same (the router's largest request).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

import grpc
import httptools
from google.protobuf.message import DecodeError
from opentelemetry import propagate, trace

from gaas.contracts import errors
from gaas.contracts.services import EXT_PROC_PROCESS
from gaas.runtime import telemetry
from gaas.runtime.interceptors import enter_call, malformed
from gaas.runtime.metrics import ServiceMetrics
from gaas.runtime.server import listen_plain
from gaas.v1 import ext_proc_pb2 as ep
from services.router.extproc import ExternalProcessor
from services.router.extproc_wire import grpc_frame

log = logging.getLogger(__name__)

METHOD = EXT_PROC_PROCESS.rsplit("/", 1)[-1]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
# gRPC's frame before a message: a compressed flag and the message's length (4 bytes, big-endian).
FRAME = struct.Struct(">BI")


class ExtProcFront:
    """Serves the decision calls of processor over HTTP/1.1 at a Unix socket or a host:port, each
    with the context a gRPC call gets from the server interceptor (gaas.runtime.interceptors), its
    metrics under the method's name, and a server span when tracing is on."""

    def __init__(self, processor: ExternalProcessor, metrics: ServiceMetrics, max_call_bytes: int,
                 tracer_provider: trace.TracerProvider | None = None) -> None:
        self.processor = processor
        self.metrics = metrics
        # The most a call may send (its messages together: the request's headers and body).
        self.max_call_bytes = max_call_bytes
        self.tracer = telemetry.plain_tracer(tracer_provider, __name__)
        self._server: asyncio.AbstractServer | None = None
        self.calls: set[_Call] = set()

    async def start(self, listen: str) -> None:
        self._server = await listen_plain(lambda: _Call(self), listen)
        log.info("decision calls over HTTP/1.1 on %s", listen)

    async def stop(self, grace: float) -> None:
        """Take no new call; let the calls running finish for grace seconds, then cut them."""
        if self._server is not None:
            self._server.close()
        running = [c.task for c in self.calls if c.task is not None]
        if running:
            await asyncio.wait(running, timeout=grace)
        for c in list(self.calls):
            c.transport.abort()


class _Call(asyncio.Protocol):
    """One connection from the sidecar: its decision calls one after another."""

    def __init__(self, front: ExtProcFront) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.task: asyncio.Task | None = None
        self.lost = False
        self._begin()

    def _begin(self) -> None:
        """A new call's state."""
        self.path = ""
        self.headers: dict[str, str] = {}
        self.pending = bytearray()
        self.received = 0
        self.requests: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()
        # Its answer has begun (its head written); it is over (its status written: the rest of the
        # call's messages are not read); the ingress ended its side (then the connection may carry
        # the next call, once this one is over).
        self.answering = False
        self.over = False
        self.ended = False

    # asyncio's side

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.front.calls.add(self)

    def connection_lost(self, exc) -> None:
        self.front.calls.discard(self)
        self.lost = self.over = True
        if self.task is not None:
            self.task.cancel()  # the ingress went away: the decision hears it as a cancellation

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._end(grpc.StatusCode.INVALID_ARGUMENT, f"malformed HTTP/1.1 call: {exc}")
            self.transport.close()

    # httptools' side

    def on_message_begin(self) -> None:
        self._begin()

    def on_url(self, url: bytes) -> None:
        self.path += url.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        if self.parser.get_method() != b"POST" or self.path != EXT_PROC_PROCESS:
            self._end(grpc.StatusCode.UNIMPLEMENTED, f"no such method here: {self.path}")
            return
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def on_body(self, body: bytes) -> None:
        if self.over:
            return
        self.received += len(body)
        if self.received > self.front.max_call_bytes:
            self._end(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a call larger than {self.front.max_call_bytes} bytes")
            return
        self.pending += body
        while len(self.pending) >= FRAME.size:
            compressed, size = FRAME.unpack_from(self.pending)
            if compressed:
                self._end(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not read here")
                return
            if len(self.pending) < FRAME.size + size:
                return
            raw = bytes(self.pending[FRAME.size:FRAME.size + size])
            del self.pending[:FRAME.size + size]
            try:
                self.requests.put_nowait(ep.ProcessingRequest.FromString(raw))
            except DecodeError:
                self._end(grpc.StatusCode.INVALID_ARGUMENT, malformed("ProcessingRequest").message)
                return

    def on_message_complete(self) -> None:
        self.ended = True
        self.requests.put_nowait(None)
        if not self.parser.should_keep_alive():
            self.transport.close()

    # Serving

    async def _messages(self):
        while (request := await self.requests.get()) is not None:
            yield request

    async def _serve(self) -> None:
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            enter_call(self.headers, edge=True)
            if self.front.tracer is None:
                await self._answer()
            else:
                with self.front.tracer.start_as_current_span(
                        EXT_PROC_PROCESS, context=propagate.extract(self.headers), kind=trace.SpanKind.SERVER):
                    await self._answer()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except errors.GaasError as exc:  # (what the processor does not answer in the stream itself)
            code = grpc.StatusCode[exc.code]
            self._end(code, exc.message)
        except Exception:  # noqa: BLE001 - a bug: the call fails, the ingress goes on without the router
            log.exception("a decision call failed")
            code = grpc.StatusCode.INTERNAL
            self._end(code, "the router failed to decide")
        finally:
            self.task = None
            self.front.metrics.rpcs.labels(METHOD, code.name).inc()
            self.front.metrics.rpc_seconds.labels(METHOD).observe(time.perf_counter() - started)
        self._end(grpc.StatusCode.OK)

    async def _answer(self) -> None:
        async for response in self.front.processor.process(self._messages()):
            message = response.SerializeToString()
            frame = grpc_frame(message)
            chunk = b"%x\r\n%s\r\n" % (len(frame), frame)
            self.transport.write(chunk if self.answering else HEAD + chunk)
            self.answering = True

    def _end(self, code: grpc.StatusCode, message: str = "") -> None:
        """The call's status: in the trailers of an answer begun, else as a trailers-only answer."""
        if self.over or self.transport is None:
            return
        self.over = True
        status = b"grpc-status: %d\r\n" % code.value[0]
        if message:
            status += b"grpc-message: %s\r\n" % _percent_encoded(message)
        if self.answering:
            self.transport.write(b"0\r\n%s\r\n" % status)
        else:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ncontent-length: 0\r\n%s\r\n"
                                 % status)


def _percent_encoded(message: str) -> bytes:
    """grpc-message's encoding: printable ASCII as is, but %; every other byte %XX."""
    return b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in message.encode())
