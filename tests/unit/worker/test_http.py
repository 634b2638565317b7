"""The worker's HTTP/1.1 front (services/worker/http.py): what its sidecar sends it and what it
answers, over a real Unix socket, with answers that stand in for the direct servicer's."""

from __future__ import annotations

import asyncio
import json

import pytest
from google.api import httpbody_pb2

from gaas.contracts import errors
from gaas.runtime.context import request_id_var
from gaas.runtime.metrics import ServiceMetrics
from services.worker.http import HttpFront
from tests.waiting import eventually_async

SSE = "text/event-stream"


def framed(message: httpbody_pb2.HttpBody) -> bytes:
    data = message.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def post(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: worker", "content-type: application/grpc", f"content-length: {len(body)}",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one response, its chunked body put back together."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    code = int(head[0].split()[1])
    headers = dict((k.lower(), v.strip()) for k, v in (line.split(":", 1) for line in head[1:] if line))
    if "content-length" in headers:
        return code, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return code, headers, body
        body += data[:-2]


class Answers:
    """Routes whose answers the test decides: pieces, a failure before them, or a stream held open."""

    def __init__(self) -> None:
        self.seen: list[httpbody_pb2.HttpBody] = []
        self.request_ids: list[str] = []
        self.fail: errors.GaasError | None = None
        self.hold = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def stream(self, request: httpbody_pb2.HttpBody):
        self.seen.append(request)
        self.request_ids.append(request_id_var.get())
        if self.fail is not None:
            raise self.fail
        for i in range(3):
            yield httpbody_pb2.HttpBody(content_type=SSE, data=f"data: {i}\n\n".encode())

    async def held(self, request: httpbody_pb2.HttpBody):
        yield httpbody_pb2.HttpBody(content_type=SSE, data=b"data: first\n\n")
        try:
            await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield httpbody_pb2.HttpBody(content_type=SSE, data=b"data: last\n\n")


@pytest.fixture
async def front(tmp_path):
    answers = Answers()
    front = HttpFront({"/gaas.v1.OpenAI/Completions": answers.stream, "/gaas.v1.OpenAI/Held": answers.held},
                      ServiceMetrics("worker-http-test"), named_as="10.0.0.1:1")
    sock = tmp_path / "http.sock"
    await front.start(f"unix:{sock}")
    reader, writer = await asyncio.open_unix_connection(str(sock))
    yield front, answers, reader, writer, sock
    writer.close()
    await front.stop(0)


async def test_an_answer_streams_as_chunks_and_the_connection_serves_the_next_request(front):
    _, answers, reader, writer, _ = front
    body = httpbody_pb2.HttpBody(content_type="application/x-gaas-direct", data=b"decided")
    for n in range(2):
        writer.write(post("/gaas.v1.OpenAI/Completions", framed(body), {"x-gaas-request-id": f"r{n}"}))
        code, headers, got = await read_response(reader)
        assert (code, headers["content-type"], got) == (200, SSE, b"data: 0\n\ndata: 1\n\ndata: 2\n\n")
    assert answers.seen == [body, body]
    assert answers.request_ids == ["r0", "r1"]


async def test_a_failure_before_the_first_byte_is_its_status_and_what_the_error_filter_reads(front):
    _, answers, reader, writer, _ = front
    answers.fail = errors.ResourceExhausted("the worker is full", retry_after=2)
    writer.write(post("/gaas.v1.OpenAI/Completions", framed(httpbody_pb2.HttpBody())))
    code, headers, got = await read_response(reader)
    assert code == 429 and headers["content-type"] == "application/json"
    status = json.loads(got)
    assert status["code"] == 8 and status["message"] == "the worker is full"
    assert any(d.get("retry_delay") == "2s" for d in status["details"])
    assert "x-gaas-unreached" not in headers


async def test_what_this_worker_did_not_take_is_marked_for_the_second_choice(front):
    _, _, reader, writer, _ = front
    writer.write(post("/gaas.v1.OpenAI/Completions", framed(httpbody_pb2.HttpBody()),
                      {"x-gaas-worker": "10.0.0.2:1,10.0.0.3:1"}))
    code, headers, got = await read_response(reader)
    assert code == 503 and headers["x-gaas-unreached"] == "1"
    assert "10.0.0.2:1" in json.loads(got)["message"]


@pytest.mark.parametrize("body", [b"", b"\x01\x00\x00\x00\x00", b"\x00\x00\x00\x00\x09short"])
async def test_a_body_that_is_not_one_grpc_message_is_refused(front, body):
    _, answers, reader, writer, _ = front
    writer.write(post("/gaas.v1.OpenAI/Completions", body))
    code, _, got = await read_response(reader)
    assert code == 400 and "gRPC message" in json.loads(got)["message"]
    assert answers.seen == []


async def test_an_unknown_path_is_404_and_garbage_closes_the_connection(front):
    _, _, reader, writer, _ = front
    writer.write(post("/gaas.v1.Worker/Nothing", b""))
    code, _, _ = await read_response(reader)
    assert code == 404
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    code, headers, _ = await read_response(reader)
    assert code == 400 and headers["connection"] == "close"
    assert await reader.read() == b""


async def test_a_client_that_hangs_up_cancels_its_answer(front):
    _, answers, reader, writer, _ = front
    writer.write(post("/gaas.v1.OpenAI/Held", framed(httpbody_pb2.HttpBody())))
    await reader.readuntil(b"data: first\n\n")
    writer.close()
    await asyncio.wait_for(answers.cancelled.wait(), 5)


async def test_stopping_lets_a_running_answer_finish_and_takes_no_new_connection(front):
    server, answers, reader, writer, sock = front
    writer.write(post("/gaas.v1.OpenAI/Held", framed(httpbody_pb2.HttpBody())))
    await reader.readuntil(b"data: first\n\n")
    stopping = asyncio.create_task(server.stop(10))
    await eventually_async(lambda: not sock.exists() or server._server is None or not server._server.is_serving())
    answers.hold.set()
    rest = await reader.read()
    assert b"data: last\n\n" in rest and rest.endswith(b"0\r\n\r\n")
    await asyncio.wait_for(stopping, 5)
    with pytest.raises(OSError):
        await asyncio.open_unix_connection(str(sock))


async def test_a_leftover_socket_is_replaced_and_one_a_live_front_holds_is_refused(tmp_path):
    sock = tmp_path / "http.sock"
    sock.touch()  # what kill -9 leaves behind
    first = HttpFront({}, ServiceMetrics("worker-http-test"))
    await first.start(f"unix:{sock}")
    second = HttpFront({}, ServiceMetrics("worker-http-test"))
    with pytest.raises(OSError, match="in use"):
        await second.start(f"unix:{sock}")
    await first.stop(0)
