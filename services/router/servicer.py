"""gaas.v1.Inference, the native gRPC API: an adapter of the request pipeline (pipeline.py), whose
GenerateRequest is already the engine request and whose chunks go out as they come; the caller's
own usage and sessions."""

from __future__ import annotations

from gaas.contracts import errors, usage as metering
from gaas.v1 import billing_pb2, inference_pb2, inference_pb2_grpc
from services.router.pipeline import Pipeline, Timing, note_client_id
from services.router.sessions import delete_response, get_response, list_response

class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, pipeline: Pipeline, read_usage=None) -> None:
        self._pipeline = pipeline
        self._directory = pipeline.stages.directory
        self._read_usage = read_usage
        self._sessions = pipeline.sessions

    async def Generate(self, request: inference_pb2.GenerateRequest, context):
        timing = Timing()
        principal = await self._pipeline.authenticate(timing)
        note_client_id(request.request_id)
        g = await self._pipeline.start(principal, [request], timing)
        async for _, chunk in self._pipeline.stream(g, context.time_remaining(),
                                                    dict(context.invocation_metadata() or ())):
            yield chunk

    async def ListModels(self, request: inference_pb2.ListModelsRequest, context) -> inference_pb2.ListModelsResponse:
        principal = await self._pipeline.caller()
        models = await self._directory.serving()
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(name=m.name, version=m.version, ready_workers=n, max_model_len=m.max_model_len,
                                        task=m.task, versions=[inference_pb2.ModelVersionInfo(version=v, role=m.role(v),
                                                                                 ready_workers=k)
                                                  for v, k in sorted(versions.items())])
                for m, n, versions in models
            ] + [
                inference_pb2.ModelInfo(name=a.name, version=m.version, ready_workers=n, max_model_len=m.max_model_len,
                                        parent=m.name)
                for m, n, _ in models for a in m.adapters.values() if a.may_use(principal.tenant)
            ]
        )

    async def GetUsage(self, request: inference_pb2.GetOwnUsageRequest, context) -> billing_pb2.UsageReport:
        principal = await self._pipeline.caller()
        if self._read_usage is None:
            raise errors.Unimplemented("usage is not available on this router")
        if request.by and request.by not in metering.USAGE_GROUPS:
            raise errors.InvalidArgument(f"by must be {', '.join(metering.USAGE_GROUPS)} (or empty for the total only)",
                                         param="by")
        now = metering.now_ms()
        start = metering.parse_time(request.since, "since", now)
        end = metering.parse_time(request.until, "until", now)
        if end and end <= start:
            raise errors.InvalidArgument("until must be after since", param="until")
        return await self._read_usage(principal.tenant, start, end, request.by)

    # ------------------------------------------------------------ sessions (the caller's own only)

    async def ListSessions(self, request: inference_pb2.ListSessionsRequest, context) -> inference_pb2.ListSessionsResponse:
        return await list_response(self._sessions, (await self._pipeline.caller()).tenant, request.limit)

    async def GetSession(self, request: inference_pb2.GetSessionRequest, context) -> inference_pb2.Session:
        return await get_response(self._sessions, (await self._pipeline.caller()).tenant, request.session_id)

    async def DeleteSession(self, request: inference_pb2.DeleteSessionRequest, context) -> inference_pb2.DeleteSessionResponse:
        return await delete_response(self._sessions, (await self._pipeline.caller()).tenant, request.session_id)

