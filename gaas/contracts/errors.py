"""GaaS's one exception tree, shared by every service, the client SDK and the CLI.

Domain code raises these (never grpc's types); each process turns them into a gRPC status in one
place (gaas.runtime.status, used by the server interceptor), and the HTTP edge turns that status
into OpenAI's error JSON in one place (the ingress's Lua filter, whose tables are generated from
STATUS_TABLE below, and openai_error() for errors inside a stream that already started).

A message is written for the caller: it says what went wrong and what to do, and never carries
internal exception text. Failures the caller did not cause (Internal) answer with a short message
and the request id; the detail goes to the service's log.

No grpc import here: the SDK, the CLI and pure domain modules use it alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# Longest message a status may carry: grpc-message travels in an HTTP/2 trailer, and an echoed
# user string must never overflow a header (Envoy answers 503 "protocol error" when it does).
MAX_MESSAGE_CHARS = 1024
# Longest user-supplied value quoted back in a message.
MAX_QUOTED_CHARS = 64


@dataclass(frozen=True, slots=True)
class StatusInfo:
    # HTTP status the ingress answers with (Envoy's gRPC -> HTTP mapping, kept in step).
    http_status: int
    # OpenAI's error "type".
    openai_type: str
    # OpenAI's error "code" when the error does not name a more precise one.
    openai_code: str


# gRPC status name -> how the HTTP edge shows it. One table: the Lua filter's is generated from it.
STATUS_TABLE: dict[str, StatusInfo] = {
    "CANCELLED": StatusInfo(499, "cancelled", "cancelled"),
    "UNKNOWN": StatusInfo(500, "server_error", "internal_error"),
    "INVALID_ARGUMENT": StatusInfo(400, "invalid_request_error", "invalid_request"),
    "DEADLINE_EXCEEDED": StatusInfo(504, "timeout_error", "deadline_exceeded"),
    "NOT_FOUND": StatusInfo(404, "not_found_error", "not_found"),
    "ALREADY_EXISTS": StatusInfo(409, "invalid_request_error", "already_exists"),
    "PERMISSION_DENIED": StatusInfo(403, "permission_error", "permission_denied"),
    "RESOURCE_EXHAUSTED": StatusInfo(429, "rate_limit_error", "rate_limit_exceeded"),
    "FAILED_PRECONDITION": StatusInfo(400, "invalid_request_error", "failed_precondition"),
    "ABORTED": StatusInfo(409, "conflict_error", "aborted"),
    "OUT_OF_RANGE": StatusInfo(400, "invalid_request_error", "out_of_range"),
    "UNIMPLEMENTED": StatusInfo(501, "not_implemented", "unimplemented"),
    "INTERNAL": StatusInfo(500, "server_error", "internal_error"),
    "UNAVAILABLE": StatusInfo(503, "service_unavailable", "unavailable"),
    "DATA_LOSS": StatusInfo(500, "server_error", "data_loss"),
    "UNAUTHENTICATED": StatusInfo(401, "authentication_error", "invalid_api_key"),
}

# HTTP statuses that Envoy itself answers (no route, no healthy upstream, body too large...).
HTTP_ONLY_TYPES = {404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error", 502: "server_error"}


def quote(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """repr() of a user-supplied value for a message, cut to limit characters."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[: limit - 4] + "...'" if text[:1] == "'" else text[: limit - 3] + "..."


def cap(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """message cut to limit characters (and made valid text, whatever it held)."""
    message = message.encode("utf-8", "replace").decode("utf-8")
    return message if len(message) <= limit else message[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class QuotaViolation:
    # Whose quota, e.g. "tenant:acme"; and which one, e.g. "requests per minute: 60".
    subject: str
    description: str


class GaasError(Exception):
    """Base of GaaS's errors. code: the gRPC status name; message: what to do about it.

    param: the request field at fault (OpenAI's "param"); reason: a precise machine-readable code
    (OpenAI's "code", e.g. "model_not_found"); retry_after: seconds after which a retry may
    succeed (HTTP Retry-After)."""

    code: ClassVar[str] = "UNKNOWN"
    # Whether the same request may succeed if sent again (elsewhere or later).
    retryable: ClassVar[bool] = False
    # Whether nothing of the request was done (a service refusing what it did not start: busy, not
    # ready): the hop before it may send it to another replica at once (headers.UNREACHED_HEADER).
    untaken: ClassVar[bool] = False

    def __init__(
        self, message: str, *, param: str | None = None, reason: str | None = None, retry_after: float | None = None,
        quota: "QuotaViolation | None" = None,
    ) -> None:
        self.message = cap(message)
        self.param = param
        self.reason = reason
        self.retry_after = retry_after
        # The quota that refused the request (google.rpc.QuotaFailure), for RESOURCE_EXHAUSTED.
        self.quota = quota
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    @property
    def info(self) -> StatusInfo:
        return STATUS_TABLE[self.code]

    @property
    def openai_code(self) -> str:
        return self.reason or self.info.openai_code

    @staticmethod
    def from_status(code: str, message: str, **extra) -> "GaasError":
        """The error a status of this code stands for (an SDK or a peer's answer)."""
        cls = _BY_CODE.get(code, GaasError)
        err = cls(message, **extra)
        if cls is GaasError:
            err.code = code if code in STATUS_TABLE else "UNKNOWN"  # type: ignore[misc]
        return err


class Cancelled(GaasError):
    code = "CANCELLED"


class InvalidArgument(GaasError):
    """The request cannot be served as sent; the message names the field."""

    code = "INVALID_ARGUMENT"


class DeadlineExceeded(GaasError):
    code = "DEADLINE_EXCEEDED"
    retryable = True


class NotFound(GaasError):
    code = "NOT_FOUND"


class AlreadyExists(GaasError):
    code = "ALREADY_EXISTS"


class PermissionDenied(GaasError):
    code = "PERMISSION_DENIED"


class ResourceExhausted(GaasError):
    """A quota, budget or queue is full; retry_after says when to come back."""

    code = "RESOURCE_EXHAUSTED"
    retryable = True


class FailedPrecondition(GaasError):
    code = "FAILED_PRECONDITION"


class Aborted(GaasError):
    """A conflict with a concurrent change (e.g. two turns of one session); retry."""

    code = "ABORTED"
    retryable = True


class Unimplemented(GaasError):
    code = "UNIMPLEMENTED"


class Internal(GaasError):
    """A fault of GaaS, not the caller's doing."""

    code = "INTERNAL"


class Unavailable(GaasError):
    """Nothing can serve the request right now; retrying shortly may succeed. Its retry delay is
    UNAVAILABLE_RETRY_S unless the raiser knows a better one, so every 503 carries Retry-After."""

    code = "UNAVAILABLE"
    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, **extra) -> None:
        super().__init__(message, retry_after=UNAVAILABLE_RETRY_S if retry_after is None else retry_after, **extra)


# What an UNAVAILABLE tells a client to wait when nothing knows better (the ingress's own 503s say the same).
UNAVAILABLE_RETRY_S = 1.0


class Unauthenticated(GaasError):
    code = "UNAUTHENTICATED"


_BY_CODE: dict[str, type[GaasError]] = {
    cls.code: cls
    for cls in (
        Cancelled, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists, PermissionDenied, ResourceExhausted,
        FailedPrecondition, Aborted, Unimplemented, Internal, Unavailable, Unauthenticated,
    )
}


def internal_message(request_id: str) -> str:
    """What a caller is told about a fault that is GaaS's own."""
    where = f" (request id {request_id})" if request_id else ""
    return f"internal error{where}: the operator can find the details in the logs; the request may be retried"


def openai_error(err: GaasError) -> dict:
    """OpenAI's error object for err: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": err.message, "type": err.info.openai_type, "param": err.param, "code": err.openai_code}}
