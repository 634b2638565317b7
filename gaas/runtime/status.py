"""GaasError <-> gRPC status, for every process: servers abort with status(), clients turn a peer's
failure back into a GaasError with from_peer() (from_rpc() when every status the peer answers is
meant for the caller). The server interceptor is the one caller of abort(); nothing else in a
service builds a status by hand.

A handler's exception becomes the GaasError its caller is told by translate(): the interceptor
answers it as the call's status; a servicer that must answer a failure inside its stream (an
OpenAI stream's SSE error event, ext_proc's ImmediateResponse) calls answer_in_stream(), which
logs and counts it as the interceptor would.

A status carries, besides code and message, google.rpc details in grpc-status-details-bin: an
ErrorInfo (reason = OpenAI's error code, metadata.param = the field at fault) and, when the error
says when to come back, a RetryInfo. The ingress's transcoder renders them into the HTTP body,
where its Lua filter picks them up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from gaas.contracts import errors
from gaas.contracts.headers import UNREACHED_HEADER
from gaas.runtime.context import answered_var, request_id_var

log = logging.getLogger(__name__)

DETAILS_KEY = "grpc-status-details-bin"
DOMAIN = "gaas"

# How a peer's failure reads to the process that called it, by the peer's status code:
# every code a failed call can end with;
ALL_CODES = frozenset(c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK)
# the peer did not answer (down, restarting, too slow): the call may succeed when retried;
UNANSWERED = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
# the peer failed on its own account: its text is its own business (and its log's);
PEER_FAILED = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS"})
# the peer's own answers to the call (invalid argument, not found, quota...), written for its caller.
PEER_ANSWERS = ALL_CODES - UNANSWERED - PEER_FAILED


def status_details(err: errors.GaasError) -> bytes:
    """The serialized google.rpc.Status of err (code, message, ErrorInfo, QuotaFailure, RetryInfo)."""
    status = status_pb2.Status(code=grpc.StatusCode[err.code].value[0], message=err.message)
    info = error_details_pb2.ErrorInfo(reason=err.openai_code, domain=DOMAIN)
    if err.param:
        info.metadata["param"] = errors.cap(err.param, 128)
    packed = any_pb2.Any()
    packed.Pack(info)
    status.details.append(packed)
    if err.quota is not None:
        failure = error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
            subject=errors.cap(err.quota.subject, 128), description=errors.cap(err.quota.description, 256))])
        packed = any_pb2.Any()
        packed.Pack(failure)
        status.details.append(packed)
    if err.retry_after is not None:
        seconds = max(0.0, err.retry_after)
        retry = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=int(seconds), nanos=int((seconds % 1) * 1e9))
        )
        packed = any_pb2.Any()
        packed.Pack(retry)
        status.details.append(packed)
    return status.SerializeToString()


def status_json(err: errors.GaasError) -> str:
    """err's google.rpc.Status as JSON, as the ingress's transcoder renders a failed call's status
    into an HTTP body (proto field names), so that the ingress's error filter gives an answer the
    mesh made itself (a refusal at the ingress) OpenAI's shape and a Retry-After as it does theirs."""
    from google.protobuf import json_format

    return json_format.MessageToJson(status_pb2.Status.FromString(status_details(err)),
                                     preserving_proto_field_name=True, indent=None)


async def abort(context: grpc.aio.ServicerContext, err: errors.GaasError) -> None:
    """End the call with err's status (raises grpc.aio.AbortError, as context.abort does)."""
    metadata = ((DETAILS_KEY, status_details(err)),)
    if err.untaken:
        metadata += ((UNREACHED_HEADER, "1"),)
    await context.abort(grpc.StatusCode[err.code], err.message, trailing_metadata=metadata)


def _details(metadata) -> dict:
    out: dict = {}
    for key, value in metadata or ():
        if key != DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except Exception:  # noqa: BLE001 - a peer's garbage is not our failure
            return out
        for packed in status.details:
            if packed.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                packed.Unpack(info)
                if info.domain == DOMAIN:
                    out["reason"] = info.reason or None
                    out["param"] = info.metadata.get("param") or None
            elif packed.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
                failure = error_details_pb2.QuotaFailure()
                packed.Unpack(failure)
                if failure.violations:
                    v = failure.violations[0]
                    out["quota"] = errors.QuotaViolation(v.subject, v.description)
            elif packed.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                packed.Unpack(retry)
                out["retry_after"] = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    return out


def from_rpc(exc: grpc.RpcError) -> errors.GaasError:
    """The GaasError a failed call stands for, with the details its peer attached."""
    code = exc.code() if hasattr(exc, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    message = (exc.details() if hasattr(exc, "details") else "") or ""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return errors.GaasError.from_status(name, message, **_details(trailing))


def from_peer(exc: grpc.RpcError, peer: str, *, passes: Collection[str] = PEER_ANSWERS,
              unanswered: Collection[str] = UNANSWERED, message: str = "",
              request_id: str | None = None) -> errors.GaasError:
    """The GaasError a process answers its own caller with when its call to peer failed with exc.

    By exc's code, in this order:
    - in passes (default: the peer's own answers, PEER_ANSWERS): the peer's error as it wrote it,
      message and details (from_rpc);
    - in unanswered (default: UNAVAILABLE, DEADLINE_EXCEEDED): Unavailable, with message, or
      "<peer> did not answer; retry shortly";
    - any other: Internal with the request id (request_id, else the current one) and none of the
      peer's text, which is for the caller's log.
    A caller states its own policy through passes and unanswered: e.g. the router's clients of
    control count any failure of control as control not answering (unanswered=ALL_CODES), and
    the operator's CLI passes on whatever its peer answered except silence (passes=ALL_CODES -
    UNANSWERED). Nothing is logged here: the caller logs the peer's code and text as it sees fit.
    """
    code = exc.code() if hasattr(exc, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    if name in passes:
        return from_rpc(exc)
    if name in unanswered:
        return errors.Unavailable(message or f"{peer} did not answer; retry shortly")
    return errors.Internal(errors.internal_message(request_id_var.get() if request_id is None else request_id))


def translate(exc: BaseException) -> errors.GaasError | None:
    """The GaasError a handler's exception answers with; None for those that must pass untouched
    (an abort already under way, a cancellation). A GaasError is itself; a peer's failure that the
    handler did not deal with is Unavailable when the peer did not answer, else Internal (its text
    is the peer's business); anything else is Internal with the request id, its traceback logged."""
    if isinstance(exc, errors.GaasError):
        return exc
    if isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError)) or not isinstance(exc, Exception):
        return None
    if isinstance(exc, grpc.RpcError):
        err = from_peer(exc, "a service this call needs", passes=())
        if isinstance(err, errors.Unavailable):
            peer = from_rpc(exc)
            log.warning("a peer did not answer: %s %s", peer.code, peer.message)
            return err
    log.error("unexpected %s: %s", type(exc).__name__, exc, exc_info=exc)
    return errors.Internal(errors.internal_message(request_id_var.get()))


def log_answer(err: errors.GaasError) -> None:
    """Log a failure a call answers its caller with (Internal and Unavailable are logged where
    they arise, with what the caller is not told)."""
    if err.code not in ("INTERNAL", "UNKNOWN", "UNAVAILABLE"):
        log.info("%s: %s", err.code, err.message)


def answer_in_stream(exc: BaseException) -> errors.GaasError | None:
    """For a servicer that answers a failure as a message of its stream rather than as the call's
    status (ext_proc's ImmediateResponse to a refused request): the GaasError to answer with, or
    None when exc must be re-raised (a cancellation). It is logged as the server interceptor logs
    the failures it answers, and the interceptor counts the call under its code in the RPC
    metrics, though the call itself ends OK.

        except Exception as exc:
            if (err := status.answer_in_stream(exc)) is None:
                raise
            yield immediate(err)
            return
    """
    err = translate(exc)
    if err is not None:
        log_answer(err)
        answered_var.set(err.code)
    return err
