"""gaas.v1.Inference: authenticate, then hand the request to the dispatcher and relay its chunks.
Also admit(), the admission step both public APIs share."""

from __future__ import annotations

import logging
import time

import grpc

from gaas.runtime.context import current_authorization, current_request_id, request_id_var, tenant_var
from gaas.v1 import inference_pb2, inference_pb2_grpc
from services.router.auth import Authenticator, Principal, Unauthenticated
from services.router.dispatch import Dispatcher, DispatchError

log = logging.getLogger(__name__)


async def admit(context, authenticator: Authenticator) -> Principal:
    """The caller's Principal, or the call aborted with UNAUTHENTICATED (or UNAVAILABLE when the
    control plane cannot be asked). Sets the tenant the rest of the mesh sees."""
    try:
        principal = await authenticator.authenticate(current_authorization())
    except Unauthenticated as exc:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
    except grpc.aio.AioRpcError as exc:
        log.warning("cannot check the API key, control unreachable: %s %s", exc.code().name, exc.details())
        await context.abort(grpc.StatusCode.UNAVAILABLE, "cannot check the API key right now; retry shortly")
    tenant_var.set(principal.tenant)  # carried to the workers as x-gaas-tenant
    return principal


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, dispatcher: Dispatcher, authenticator: Authenticator) -> None:
        self._dispatcher = dispatcher
        self._auth = authenticator

    async def Generate(self, request: inference_pb2.GenerateRequest, context):
        arrived = time.perf_counter()
        principal = await admit(context, self._auth)
        request_id = request.request_id or current_request_id()
        request_id_var.set(request_id)  # the client's own id, when it chose one, names the request everywhere
        try:
            async for chunk in self._dispatcher.stream(
                request, principal, request_id, context.time_remaining(), arrived
            ):
                yield chunk
        except DispatchError as exc:
            await context.abort(exc.code, exc.message)

    async def ListModels(self, request: inference_pb2.ListModelsRequest, context) -> inference_pb2.ListModelsResponse:
        await admit(context, self._auth)
        try:
            models = await self._dispatcher.models()
        except DispatchError as exc:
            await context.abort(exc.code, exc.message)
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(name=m.name, version=m.version, ready_workers=n, max_model_len=m.max_model_len)
                for m, n in models
            ]
        )
