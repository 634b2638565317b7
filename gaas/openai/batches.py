"""OpenAI's Files and Batch APIs, translated: a batch input file's lines, the create body, and
GaaS's files and batches (billing's protobufs) as OpenAI's objects and output lines (an upload's
multipart body is gaas.openai.multipart's). Pure functions, no I/O; failures are gaas.contracts.errors.InvalidArgument.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from gaas.contracts import batches as terms, jsonbody
from gaas.contracts.errors import InvalidArgument, quote
from gaas.contracts.jsonbody import Fields
from gaas.v1 import billing_pb2

MAX_METADATA = 16


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    # The request's JSON body, as written.
    body: bytes


def parse_lines(data: bytes, endpoint: str, max_items: int) -> tuple[list[BatchLine], list[billing_pb2.BatchError]]:
    """A batch input file's requests ({"custom_id", "method": "POST", "url": endpoint, "body"} per
    line), or the errors of the lines that are not (each naming its line, as OpenAI's do)."""
    items: list[BatchLine] = []
    errors: list[billing_pb2.BatchError] = []
    seen: set[str] = set()

    def bad(line: int, code: str, message: str, param: str = "") -> None:
        if len(errors) < 100:
            errors.append(billing_pb2.BatchError(code=code, line=line, message=message, param=param))

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return [], [billing_pb2.BatchError(code="invalid_json_line", message="the file is not UTF-8 text")]
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            # (a line's body is held to a request body's limits: one level deeper, the line's own)
            doc = jsonbody.loads(raw, "line", jsonbody.MAX_DEPTH + 1)
        except InvalidArgument as exc:
            bad(n, "invalid_json_line", f"this line is not a JSON object within the limits of a request: {exc.message}")
            continue
        if not isinstance(doc, dict):
            bad(n, "invalid_json_line", "this line is not a JSON object")
            continue
        extra = set(doc) - {"custom_id", "method", "url", "body"}
        custom_id, body = doc.get("custom_id"), doc.get("body")
        if extra:
            bad(n, "invalid_request", f"unknown field(s) {', '.join(sorted(extra))}: a line has custom_id, method, "
                "url and body", sorted(extra)[0])
        elif not isinstance(custom_id, str) or not 0 < len(custom_id) <= 512:
            bad(n, "missing_required_parameter", "custom_id must be a string of 1 to 512 characters", "custom_id")
        elif custom_id in seen:
            bad(n, "duplicate_custom_id", f"custom_id {quote(custom_id)} is used by an earlier line; each request "
                "needs its own", "custom_id")
        elif doc.get("method") != "POST":
            bad(n, "invalid_method", "method must be \"POST\"", "method")
        elif doc.get("url") != endpoint:
            bad(n, "mismatched_endpoint", f"url must be the batch's endpoint, {endpoint}", "url")
        elif not isinstance(body, dict):
            bad(n, "invalid_request", "body must be the request's JSON object", "body")
        elif not isinstance(body.get("model"), str):
            bad(n, "missing_required_parameter", "body.model must name the model", "body.model")
        elif body.get("stream") not in (None, False):
            bad(n, "invalid_request", "a batch request cannot be streamed (\"stream\": true)", "body.stream")
        else:
            seen.add(custom_id)
            items.append(BatchLine(custom_id, json.dumps(body, separators=(",", ":")).encode()))
    if not items and not errors:
        errors.append(billing_pb2.BatchError(code="empty_file", message="the file has no request lines"))
    if len(items) + len(errors) > max_items:
        return [], [billing_pb2.BatchError(code="too_many_requests",
                                           message=f"a batch can hold at most {max_items} requests")]
    return items, errors


@dataclass(frozen=True, slots=True)
class CreateBatch:
    input_file_id: str
    endpoint: str
    metadata: dict[str, str]


def parse_create(doc: dict) -> CreateBatch:
    """POST /v1/batches' body (a JSON object: jsonbody.parse)."""
    f = Fields(doc)
    input_file_id = f.string("input_file_id", 128, empty_ok=False)
    if input_file_id is None:
        raise InvalidArgument("'input_file_id' is required: the id of a file uploaded with purpose \"batch\"",
                              param="input_file_id")
    endpoint = f.string("endpoint", 64)
    if endpoint not in terms.ENDPOINTS:
        raise InvalidArgument(f"'endpoint' must be one of {', '.join(terms.ENDPOINTS)} (got "
                              f"{quote(endpoint or 'none')})", param="endpoint")
    window = f.string("completion_window", 16)
    if window != terms.COMPLETION_WINDOW:
        raise InvalidArgument(f"'completion_window' must be {quote(terms.COMPLETION_WINDOW)}", param="completion_window")
    f.only_default("output_expires_after", lambda v: False, "output files are kept until deleted")
    metadata = f.raw("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()):
        raise InvalidArgument(f"'metadata' maps at most {MAX_METADATA} keys (up to 64 characters) to strings (up to "
                              "512)", param="metadata")
    f.finish()
    return CreateBatch(input_file_id, endpoint, dict(metadata))


def page_params(limit: int, default: int = 20) -> int:
    if limit > 100:
        raise InvalidArgument("limit must be between 1 and 100", param="limit")
    return limit or default


# ------------------------------------------------------------------ objects

def file_object(f: billing_pb2.BatchFile) -> dict:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": f.created_at,
            "expires_at": f.expires_at or None, "filename": f.filename, "purpose": f.purpose, "status": "processed",
            "status_details": None}


def file_deleted(f: billing_pb2.BatchFile) -> dict:
    return {"id": f.id, "object": "file", "deleted": True}


def batch_object(b: billing_pb2.Batch) -> dict:
    def at(v: int):
        return v or None

    errors = ({"object": "list", "data": [{"code": e.code, "message": e.message, "param": e.param or None,
                                            "line": e.line or None} for e in b.errors]} if b.errors else None)
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": errors,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id or None, "error_file_id": b.error_file_id or None,
        "created_at": b.created_at, "in_progress_at": at(b.in_progress_at), "expires_at": at(b.expires_at),
        "finalizing_at": at(b.finalizing_at), "completed_at": at(b.completed_at), "failed_at": at(b.failed_at),
        "expired_at": at(b.expired_at), "cancelling_at": at(b.cancelling_at), "cancelled_at": at(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": dict(b.metadata) or None,
    }


def listing(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _line(doc: dict) -> bytes:
    return json.dumps({"id": "batch_req_" + uuid.uuid4().hex, **doc}, separators=(",", ":")).encode() + b"\n"


def answer_line(custom_id: str, request_id: str, status_code: int, body: bytes) -> bytes:
    """One line of a batch's output (status 200) or error file, OpenAI's shape, for an answer
    already written as JSON (the router's body): spliced in as it is rather than parsed and
    written again, so a line costs one copy of its answer. A JSON document's raw newlines are
    whitespace, so they become spaces (one line per answer)."""
    if b"\n" in body:
        body = body.replace(b"\n", b" ")
    head = json.dumps({"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id}, separators=(",", ":"))
    response = json.dumps({"status_code": status_code, "request_id": request_id}, separators=(",", ":"))
    return b"".join((head[:-1].encode(), b',"response":', response[:-1].encode(), b',"body":', body or b"null",
                     b'},"error":null}\n'))


def error_line(custom_id: str, code: str, message: str) -> bytes:
    """The error line of a request that has no answer (it never ran, or could not)."""
    return _line({"custom_id": custom_id, "response": None, "error": {"code": code, "message": message}})


# Why a request of a batch that stopped never ran: the batch's ending -> (code, message).
UNRUN = {
    "expired": ("batch_expired", "this request was not run before the batch's 24 h window closed"),
    "cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
    "output_limit": ("batch_output_limit", "this request was not run: the batch's answers reached the most it, or "
                     "its tenant, may keep (batches.max_output_bytes, batches.max_tenant_bytes)"),
}


def unrun_line(custom_id: str, ending: str) -> bytes:
    """The error line of a request its batch's end (expired, cancelled, its output full) stopped
    before it ran."""
    return error_line(custom_id, *UNRUN[ending])
