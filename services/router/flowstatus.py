"""gaas.v1.Router (the operator's, through the router's sidecar): the router's flow control, as
`gaas status` shows it, and any tenant's sessions (`gaas session ... --tenant NAME`)."""

from __future__ import annotations

from gaas.contracts import errors
from gaas.contracts.qos import BAND_NAMES
from gaas.contracts.tenancy import TENANT_NAME_RE
from gaas.runtime.metrics import nearest_rank
from gaas.v1 import router_pb2 as pb
from gaas.v1 import inference_pb2, router_pb2_grpc
from services.router.activity import TenantActivity
from services.router.flow import Flow
from services.router.sessions import SessionStore, delete_response, get_response, list_response


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, name: str, flow: Flow, activity: TenantActivity | None = None,
                 sessions: SessionStore | None = None) -> None:
        self._name = name
        self._flow = flow
        self._activity = activity or TenantActivity()
        self._sessions = sessions

    async def ListTenantSessions(self, request: pb.TenantSessionsRequest, context) -> inference_pb2.ListSessionsResponse:
        return await list_response(self._sessions, _tenant(request.tenant), request.limit)

    async def GetTenantSession(self, request: pb.TenantSessionRequest, context) -> inference_pb2.Session:
        return await get_response(self._sessions, _tenant(request.tenant), request.session_id)

    async def DeleteTenantSession(self, request: pb.TenantSessionRequest, context) -> inference_pb2.DeleteSessionResponse:
        return await delete_response(self._sessions, _tenant(request.tenant), request.session_id)

    async def GetFlowStatus(self, request: pb.GetFlowStatusRequest, context) -> pb.FlowStatus:
        flow = self._flow
        bands = [
            pb.BandFlow(band=BAND_NAMES[i], waiting=s.waiting, queued=s.queued, admitted=s.admitted, shed=s.shed,
                        timed_out=s.timed_out, wait_p95_ms=nearest_rank(s.waits, 0.95) * 1000)
            for i, s in enumerate(flow.queue.stats)
        ]
        breakers = flow.breakers.state()
        workers = []
        for worker, w in sorted(flow.windows.state().items()):
            b = breakers.get(worker)
            workers.append(pb.WorkerFlow(
                worker_id=worker, window=w.limit, in_flight=w.in_flight, window_shrinks=w.shrinks,
                window_grows=w.grows, breaker=b.state if b else "closed", breaker_trips=b.trips if b else 0,
                ttft_threshold_ms=flow.breakers.threshold_ms(worker),
            ))
        tenants = [pb.TenantFlow(tenant=t.tenant, tier=t.tier, in_flight=t.in_flight, requests_1m=t.requests,
                                 tokens_1m=t.tokens) for t in self._activity.snapshot()]
        return pb.FlowStatus(router=self._name, qos_enabled=flow.settings.enabled, bands=bands, workers=workers,
                             tenants=tenants)


def _tenant(name: str) -> str:
    if not TENANT_NAME_RE.fullmatch(name):
        raise errors.InvalidArgument("tenant must be a tenant's name (see `gaas tenant list`)", param="tenant")
    return name
