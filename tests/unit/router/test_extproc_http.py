"""The router's decision calls over HTTP/1.1 (services/router/extproc_http.py): Envoy's ext_proc
stream as the router's sidecar forwards it, over a real Unix socket, with a processor whose
answers the test decides."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gaas.contracts import errors
from gaas.contracts.services import EXT_PROC_PROCESS
from gaas.runtime.context import request_id_var
from gaas.runtime.metrics import ServiceMetrics
from gaas.v1 import ext_proc_pb2 as ep
from services.router.extproc_http import ExtProcFront
from tests.waiting import eventually_async


def frame(message) -> bytes:
    data = message.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD = (f"POST {EXT_PROC_PROCESS} HTTP/1.1\r\nhost: router\r\ncontent-type: application/grpc\r\n"
        "transfer-encoding: chunked\r\nx-request-id: req-1\r\n\r\n").encode()
HEADERS = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=ep.HeaderMap(headers=[
    ep.HeaderValue(key=":path", raw_value=b"/v1/completions")])))
BODY = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}", end_of_stream=True))


async def read_call(reader: asyncio.StreamReader) -> tuple[dict[str, str], list[ep.ProcessingResponse], dict[str, str]]:
    """(headers, messages, trailers) of one answer; a trailers-only answer's status is in its headers."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    assert head[0] == "HTTP/1.1 200 OK"
    headers = dict((k.lower(), v.strip()) for k, v in (line.split(":", 1) for line in head[1:] if line))
    if headers.get("content-length") == "0":
        return headers, [], {}
    body = b""
    while (size := int((await reader.readline()).strip(), 16)) > 0:
        body += (await reader.readexactly(size + 2))[:-2]
    trailers = dict((k.lower(), v.strip()) for k, v in (
        line.split(":", 1) for line in (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n") if line))
    messages = []
    while body:
        size = int.from_bytes(body[1:5], "big")
        messages.append(ep.ProcessingResponse.FromString(body[5:5 + size]))
        body = body[5 + size:]
    return headers, messages, trailers


class Processor:
    """Answers the headers and the body once both arrived, as the router's does; or fails, or holds."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self.request_ids: list[str] = []
        self.fail: Exception | None = None
        self.hold = False
        self.cancelled = asyncio.Event()

    async def process(self, requests):
        kinds: list[str] = []
        self.seen.append(kinds)
        self.request_ids.append(request_id_var.get())
        try:
            async for r in requests:
                kinds.append(r.WhichOneof("request"))
                if self.fail is not None:
                    raise self.fail
                if r.WhichOneof("request") == "request_body" and r.request_body.end_of_stream:
                    break
            if self.hold:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        yield ep.ProcessingResponse(request_body=ep.BodyResponse())


@pytest.fixture
async def served(tmp_path):
    processor = Processor()
    metrics = ServiceMetrics("router-test")
    front = ExtProcFront(processor, metrics, max_call_bytes=4096)
    sock = tmp_path / "http.sock"
    await front.start(f"unix:{sock}")
    reader, writer = await asyncio.open_unix_connection(str(sock))
    yield processor, front, metrics, reader, writer
    writer.close()
    await front.stop(1.0)


async def test_each_message_is_handed_over_as_it_arrives_and_each_answer_is_one_frame(served):
    processor, _, metrics, reader, writer = served
    writer.write(HEAD + chunk(frame(HEADERS)))
    await eventually_async(lambda: processor.seen == [["request_headers"]], 5, what="the headers handed over alone")
    writer.write(chunk(frame(BODY)))
    headers, messages, trailers = await read_call(reader)
    assert headers["content-type"] == "application/grpc"
    assert [m.WhichOneof("response") for m in messages] == ["request_headers", "request_body"]
    assert trailers == {"grpc-status": "0"}
    # The call's context, as the gRPC interceptor set it: at the edge, an id of GaaS's own.
    assert processor.request_ids[0].startswith("req-") and processor.request_ids[0] != "req-1"
    assert metrics.rpcs.labels("Process", "OK")._value.get() == 1


async def test_the_next_call_takes_the_same_connection_once_the_ingress_ended_its_side(served):
    processor, _, _, reader, writer = served
    for _ in range(2):
        writer.write(HEAD + chunk(frame(HEADERS)) + chunk(frame(BODY)) + b"0\r\n\r\n")
        _, messages, trailers = await read_call(reader)
        assert len(messages) == 2 and trailers == {"grpc-status": "0"}
    assert len(processor.seen) == 2 and len(set(processor.request_ids)) == 2


async def test_a_failure_before_any_answer_is_a_trailers_only_status(served):
    processor, _, metrics, reader, writer = served
    processor.fail = errors.Unavailable("no router: 100% busy")
    writer.write(HEAD + chunk(frame(HEADERS)))
    headers, messages, _ = await read_call(reader)
    assert messages == []
    assert headers["grpc-status"] == str(grpc.StatusCode.UNAVAILABLE.value[0])
    assert headers["grpc-message"] == "no router: 100%25 busy"
    assert metrics.rpcs.labels("Process", "UNAVAILABLE")._value.get() == 1


async def test_a_call_past_the_limit_is_refused_and_not_held(served):
    processor, _, _, reader, writer = served
    huge = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"x" * 5000, end_of_stream=True))
    writer.write(HEAD + chunk(frame(HEADERS)) + chunk(frame(huge)))
    headers, _, _ = await read_call(reader)
    assert headers["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])


async def test_an_unknown_method_is_unimplemented_and_nothing_is_decided(served):
    processor, _, _, reader, writer = served
    writer.write(HEAD.replace(EXT_PROC_PROCESS.encode(), b"/gaas.v1.Router/Nope"))
    headers, _, _ = await read_call(reader)
    assert headers["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0])
    assert processor.seen == []


async def test_a_hang_up_cancels_the_decision(served):
    processor, front, _, _, writer = served
    processor.hold = True
    writer.write(HEAD + chunk(frame(HEADERS)) + chunk(frame(BODY)))
    await eventually_async(lambda: processor.seen == [["request_headers", "request_body"]], 5,
                           what="the call held")
    writer.close()
    await asyncio.wait_for(processor.cancelled.wait(), 5)
    await eventually_async(lambda: not front.calls, 5, what="the connection forgotten")
