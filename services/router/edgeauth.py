"""The ingress's key check (Envoy's external authorization, envoy.service.auth.v3; the part of it
used here is protos/gaas/v1/ext_authz.proto): the ingress asks a router about every request on
its headers alone, before it reads the request's body, so a request without a valid key costs the
mesh its headers and one cached lookup, never a buffered body, a transcoding or a parse.

What may pass without a key is what vLLM's server serves without one: the probes (gaas.v1.OpenAI's
methods that take a ProbeRequest, by their HTTP routes and their gRPC paths), gRPC health and
server reflection. Everything else needs a key the control plane knows; an address that keeps
sending unknown keys is slowed (services/router/auth.FailedAuthLimiter): the client's address as
the ingress decided it (behind load balancers it trusts, the one they say), not the connection's. A refusal is answered in
the shape the ingress's error filter turns into OpenAI's (gaas.runtime.status.status_json), or as
a bare message for a gRPC client, whose status Envoy derives from the HTTP one.
"""

from __future__ import annotations

from google.api import annotations_pb2
from google.rpc import status_pb2

from gaas.contracts import edge
from gaas.contracts.errors import GaasError
from gaas.runtime import status
from gaas.v1 import ext_authz_pb2 as az
from gaas.v1 import ext_authz_pb2_grpc, openai_pb2
from services.router.auth import Authenticator

ALLOWED = az.CheckResponse(status=status_pb2.Status(code=0), ok_response=az.OkHttpResponse())


def open_paths() -> frozenset[str]:
    """The paths a request may take at the ingress without a key: each probe of gaas.v1.OpenAI (its
    gRPC path and every HTTP route the proto binds it to)."""
    service = openai_pb2.DESCRIPTOR.services_by_name["OpenAI"]
    out: set[str] = set()
    for method in service.methods:
        if method.input_type.full_name != "gaas.v1.ProbeRequest":
            continue
        out.add(f"/{service.full_name}/{method.name}")
        rule = method.GetOptions().Extensions[annotations_pb2.http]
        for binding in (rule, *rule.additional_bindings):
            if (kind := binding.WhichOneof("pattern")) and kind != "custom":
                out.add(getattr(binding, kind))
    return frozenset(out)


OPEN_PREFIXES = tuple(f"/{name}/" for name in edge.OPEN_GRPC_SERVICES)


def denied(err: GaasError, grpc_client: bool) -> az.CheckResponse:
    """The ingress's answer to a refused request: err's HTTP status, with the body the ingress's
    error filter reads (or err's message alone, for a gRPC client) and Retry-After when err says."""
    headers = [az.HeaderValueOption(header=az.HeaderValue(key="content-type", raw_value=(
        b"text/plain" if grpc_client else b"application/json")))]
    if err.retry_after is not None:
        headers.append(az.HeaderValueOption(header=az.HeaderValue(
            key="retry-after", raw_value=str(max(1, round(err.retry_after))).encode())))
    return az.CheckResponse(
        status=status_pb2.Status(code=16 if err.code == "UNAUTHENTICATED" else 7, message=err.message),
        denied_response=az.DeniedHttpResponse(status=az.HttpStatus(code=err.info.http_status), headers=headers,
                                              body=err.message if grpc_client else status.status_json(err)),
    )


class EdgeAuthorizer(ext_authz_pb2_grpc.AuthorizationServicer):
    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator
        self._open = open_paths()

    def is_open(self, path: bytes) -> bool:
        path = path.split(b"?", 1)[0].decode("latin-1")
        return path in self._open or path.startswith(OPEN_PREFIXES)

    async def Check(self, request: az.CheckRequest, context) -> az.CheckResponse:
        http = request.attributes.request.http
        if self.is_open(http.path):
            return ALLOWED
        # (Header values are bytes: a key is ASCII, anything else in one is no key we made.)
        headers = {k: v.decode("latin-1") for k, v in http.headers.items()}
        # The client's address as the ingress decided it (a trusted load balancer's word for it,
        # edge.CLIENT_ADDRESS_HEADER, set over a client's own); the connection's peer otherwise.
        client = headers.get(edge.CLIENT_ADDRESS_HEADER) or request.attributes.source.address.socket_address.address
        try:
            await self._auth.authenticate(headers.get("authorization", ""), client)
        except GaasError as err:
            return denied(err, headers.get("content-type", "").startswith("application/grpc"))
        return ALLOWED
