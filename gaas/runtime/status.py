"""GaasError <-> gRPC status, for every process: servers abort with status(), clients turn a peer's
failure back into a GaasError with from_rpc(). The server interceptor is the one caller of
abort(); nothing else in a service builds a status by hand.

A status carries, besides code and message, google.rpc details in grpc-status-details-bin: an
ErrorInfo (reason = OpenAI's error code, metadata.param = the field at fault) and, when the error
says when to come back, a RetryInfo. The ingress's transcoder renders them into the HTTP body,
where its Lua filter picks them up.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from gaas.contracts import errors

DETAILS_KEY = "grpc-status-details-bin"
DOMAIN = "gaas"


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
    await context.abort(grpc.StatusCode[err.code], err.message, trailing_metadata=((DETAILS_KEY, status_details(err)),))


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

