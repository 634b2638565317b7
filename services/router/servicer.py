"""gaas.v1.Inference: authenticate, then hand the request to the dispatcher and relay its chunks.
Also admit(), the admission step both public APIs share."""

from __future__ import annotations

import time

from gaas.runtime.context import (
    client_request_id_var,
    current_authorization,
    current_request_id,
    sanitize_client_id,
    tenant_var,
)
from gaas.v1 import inference_pb2, inference_pb2_grpc
from services.router.auth import Authenticator, Principal
from services.router.dispatch import Dispatcher


async def admit(authenticator: Authenticator) -> Principal:
    """The caller's Principal (errors.Unauthenticated, or Unavailable when the control plane cannot
    be asked). Sets the tenant the rest of the mesh sees."""
    principal = await authenticator.authenticate(current_authorization())
    tenant_var.set(principal.tenant)  # carried to the workers as x-gaas-tenant
    return principal


def note_client_id(client_id: str) -> None:
    """The id a client gave in its request body, for the logs (the x-request-id header wins)."""
    if client_id and not client_request_id_var.get():
        client_request_id_var.set(sanitize_client_id(client_id))


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, dispatcher: Dispatcher, authenticator: Authenticator) -> None:
        self._dispatcher = dispatcher
        self._auth = authenticator

    async def Generate(self, request: inference_pb2.GenerateRequest, context):
        arrived = time.perf_counter()
        principal = await admit(self._auth)
        note_client_id(request.request_id)
        prepared = await self._dispatcher.prepare(request, principal)
        async for chunk in self._dispatcher.stream(
            prepared, principal, current_request_id(), context.time_remaining(), arrived
        ):
            yield chunk

    async def ListModels(self, request: inference_pb2.ListModelsRequest, context) -> inference_pb2.ListModelsResponse:
        await admit(self._auth)
        models = await self._dispatcher.models()
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(name=m.name, version=m.version, ready_workers=n, max_model_len=m.max_model_len)
                for m, n in models
            ]
        )
