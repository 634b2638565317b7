"""What the router and Envoy's external processing filter say to each other on the direct path
(extproc.py decides): gRPC frames in a body, headers in and out, and the answers that are not a
decision (a refusal, in the client's shape; a request let through undecided; a body too large)."""

from __future__ import annotations

import base64
import struct

import grpc
from google.protobuf.message import DecodeError

from gaas.contracts import errors
from gaas.runtime import status
from gaas.runtime.context import WORKER_HEADER
from gaas.runtime.interceptors import malformed
from gaas.v1 import ext_proc_pb2 as ep


def grpc_frame(message: bytes) -> bytes:
    """One uncompressed gRPC message frame."""
    return struct.pack(">BI", 0, len(message)) + message


def grpc_unframe(body: bytes) -> bytes:
    """The message of a request body holding one uncompressed gRPC frame."""
    if len(body) < 5:
        raise errors.InvalidArgument("the request body is empty")
    compressed, size = struct.unpack(">BI", body[:5])
    if compressed or len(body) != 5 + size:
        raise errors.InvalidArgument("the request body is not one uncompressed gRPC message")
    return body[5:]


def message_of(cls, body: bytes):
    """The request message of a request body of one gRPC frame, refused as the router's own routes
    refuse one that does not parse (gaas.runtime.interceptors.malformed)."""
    try:
        return cls.FromString(grpc_unframe(body))
    except DecodeError:
        raise malformed(cls.__name__) from None


def header(key: str, value: str) -> ep.HeaderValueOption:
    return ep.HeaderValueOption(header=ep.HeaderValue(key=key, raw_value=value.encode()),
                                append_action=ep.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def headers_of(header_map) -> dict[str, str]:
    return {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in header_map.headers}


def too_large() -> ep.ProcessingResponse:
    """The answer to an OpenAI request whose body passes what the ingress takes (the router's limit
    and the framing's room, gaas.contracts.edge), as the ingress gave it when its transcoder read
    the body first: 413, which the ingress's error filter words with the limit (a body between the
    two is jsonbody's 400 naming it)."""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=ep.HttpStatus(code=413), body=b"Payload Too Large", details="request_too_large"))


def immediate(err: errors.GaasError) -> ep.ProcessingResponse:
    """The client's answer to a refused request, as the ingress's transcoder renders a failed call
    of the router's own routes (the HTTP status of err's code, the google.rpc.Status as JSON), so
    that its error filter gives it OpenAI's shape and Retry-After as it does theirs. (The ingress
    answers an HTTP client here, not a gRPC one: the transcoder does not see this answer.)"""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=ep.HttpStatus(code=err.info.http_status),
        body=status.status_json(err).encode(),
        headers=ep.HeaderMutation(set_headers=[header("content-type", "application/json")]),
        details=err.code,
    ))


def immediate_grpc(err: errors.GaasError) -> ep.ProcessingResponse:
    """A gRPC client's answer to a refused request (the native API's Generate): the trailers-only
    response the router's own route would give, its status, message and details (retry delay,
    quota) as the server interceptor sets them."""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=ep.HttpStatus(code=200),
        grpc_status=ep.GrpcStatus(status=grpc.StatusCode[err.code].value[0]),
        body=err.message.encode(),
        headers=ep.HeaderMutation(set_headers=[header(status.DETAILS_KEY, base64.b64encode(
            status.status_details(err)).decode())]),
        details=err.code,
    ))


# The transcoder keeps a JSON request's own path here: such a native request's client reads HTTP.
TRANSCODED_HEADER = "x-envoy-original-path"


def passed_on(body: bytes) -> list[ep.ProcessingResponse]:
    """Let the request go on unchanged to the router's own route (whatever worker a client named)."""
    return [
        ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=ep.HeaderMutation(remove_headers=[WORKER_HEADER]), clear_route_cache=True))),
        ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=True))))),
    ]
