"""The GaaS client SDK: streaming generation over gRPC through the ingress.

    from gaas.sdk.client import GaasClient
    with GaasClient("127.0.0.1:8080") as client:
        for chunk in client.generate("Once upon a time", max_tokens=32):
            print(chunk.text, end="", flush=True)

Errors are gaas.contracts.errors.GaasError subclasses (NotFound, InvalidArgument, Unavailable...), carrying
the gRPC status code name (code), the service's message, and the request field at fault (param).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from gaas.contracts.errors import GaasError  # noqa: F401 - the SDK's error type, importable from here
from gaas.runtime.status import from_rpc
from gaas.v1 import common_pb2, inference_pb2, inference_pb2_grpc

PRIORITIES = {
    "low": common_pb2.PRIORITY_LOW,
    "normal": common_pb2.PRIORITY_NORMAL,
    "high": common_pb2.PRIORITY_HIGH,
}


class GenerateStream:
    """Iterates GenerateChunk messages; cancel() stops the generation (the engine aborts it)."""

    def __init__(self, call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[common_pb2.GenerateChunk]:
        try:
            yield from self._call
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise from_rpc(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


class GaasClient:
    def __init__(self, target: str = "127.0.0.1:8080", *, api_key: str | None = None, tls: bool = False,
                 tls_roots: bytes | None = None) -> None:
        """tls: the ingress serves TLS (`gaas up --tls-cert`); tls_roots: the certificates to trust
        for it (PEM), else the system's."""
        self.target = target
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if tls:
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=tls_roots))
        else:
            self._channel = grpc.insecure_channel(target)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        model: str = "",
        max_tokens: int = 0,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        priority: str = "normal",
        session_id: str = "",
        request_id: str = "",
        n: int = 1,
        logprobs: int | None = None,
        timeout: float | None = None,
        messages: Sequence[tuple[str, str]] | None = None,
        **sampling_fields,
    ) -> GenerateStream:
        """Start a generation; prompt is text or a list of token ids, or messages a conversation of
        (role, content) pairs (prompt then ""). Other keyword arguments are gaas.v1.SamplingParams
        fields (min_p=0.1, ignore_eos=True, stop_token_ids=[...], ...). With n > 1 the choices'
        chunks interleave; chunk.index tells them apart. session_id makes it a turn of that session:
        send only the new prompt or messages; the last chunk's `session` says what the turn did."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
        fields = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, **sampling_fields}
        sampling = common_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
        req = inference_pb2.GenerateRequest(
            model=model,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=list(stop),
            priority=PRIORITIES[priority],
            session_id=session_id,
            request_id=request_id,
            n=n,
        )
        if logprobs is not None:
            req.logprobs = logprobs
        if messages is not None:
            req.messages.extend(inference_pb2.ChatMessage(role=r, content=c) for r, c in messages)
        elif isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.extend(prompt)
        return GenerateStream(self._stub.Generate(req, timeout=timeout, metadata=self._metadata))

    def list_models(self, timeout: float = 5.0) -> list[inference_pb2.ModelInfo]:
        try:
            resp = self._stub.ListModels(inference_pb2.ListModelsRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None
        return list(resp.models)

    def usage(self, since: str = "", until: str = "", by: str = "", timeout: float = 10.0):
        """The calling tenant's own usage (a billing_pb2.UsageReport)."""
        try:
            return self._stub.GetUsage(
                inference_pb2.GetOwnUsageRequest(since=since, until=until, by=by), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None

    def _unary(self, method: str, request, timeout: float):
        try:
            return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None

    def list_sessions(self, limit: int = 100, timeout: float = 10.0) -> list[inference_pb2.Session]:
        """The calling tenant's sessions, most recent first (without their messages)."""
        return list(self._unary("ListSessions", inference_pb2.ListSessionsRequest(limit=limit), timeout).sessions)

    def get_session(self, session_id: str, timeout: float = 10.0) -> inference_pb2.Session:
        return self._unary("GetSession", inference_pb2.GetSessionRequest(session_id=session_id), timeout)

    def delete_session(self, session_id: str, timeout: float = 10.0) -> None:
        self._unary("DeleteSession", inference_pb2.DeleteSessionRequest(session_id=session_id), timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "GaasClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
