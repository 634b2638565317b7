"""gaas.v1.Inference: authenticate, then hand the request to the dispatcher and relay its chunks.
Also admit(), the admission step both public APIs share."""

from __future__ import annotations

import contextlib
import time

from gaas.contracts import errors, latency, usage as metering
from gaas.contracts.pricing import FREE
from gaas.runtime.context import (
    client_request_id_var,
    current_authorization,
    current_request_id,
    sanitize_client_id,
    tenant_var,
)
from gaas.v1 import billing_pb2, inference_pb2, inference_pb2_grpc
from services.router.auth import Authenticator, Principal
from services.router.dispatch import Dispatcher, Prepared
from gaas.metering.meter import Meter, Metered, metered
from services.router.sessions import (
    SessionStore, TurnPlan, available, check_turn, committing, delete_response, get_response, list_response, plan_turn,
)

async def admit(authenticator: Authenticator) -> Principal:
    """The caller's Principal (errors.Unauthenticated, or Unavailable when the control plane cannot
    be asked). Sets the tenant the rest of the mesh sees."""
    principal = await authenticator.authenticate(current_authorization())
    tenant_var.set(principal.tenant)  # carried to the workers as x-gaas-tenant
    return principal


async def admit_generation(authenticator: Authenticator, meter: Meter | None) -> Principal:
    """admit() for a generation: its tenant refused at once, before its body is parsed, sessions
    read or prompt tokenized, when this router's own count says it cannot be admitted (over its
    sequences at once, or its requests a minute: Meter.precheck)."""
    principal = await admit(authenticator)
    if meter is not None:
        meter.precheck(principal)
    return principal


def note_client_id(client_id: str) -> None:
    """The id a client gave in its request body, for the logs (the x-request-id header wins)."""
    if client_id and not client_request_id_var.get():
        client_request_id_var.set(sanitize_client_id(client_id))


async def admit_usage(
    meter: Meter | None, principal: Principal, prepared: list[Prepared], request_id: str, parts_tokens: int,
    arrived: float, session_id: str = "",
) -> Metered | None:
    """The quotas and budget check of a request about to start (parts_tokens: the most tokens it
    generates; its sequences: each prompt's n choices)."""
    if meter is None:
        return None
    model = prepared[0].model
    m = await meter.admit(
        principal, request_id, model.name, model.version, model.prices.get(principal.tier, FREE),
        sum(p.prompt_tokens for p in prepared), parts_tokens, len(prepared), client_request_id_var.get(), arrived,
        sequences=sum(p.request.n or 1 for p in prepared),
    )
    m.session_id = session_id
    return m


async def prepare_one(dispatcher: Dispatcher, sessions: SessionStore | None, request: inference_pb2.GenerateRequest,
                      principal: Principal, request_id: str) -> tuple[Prepared, TurnPlan | None]:
    """A request prepared for a worker; a session's turn with its stored context before it (the
    session's turn then held: whoever gets a plan releases it through sessions.committing, or
    release_later when it never streams)."""
    if not check_turn(request):
        return await dispatcher.prepare(request, principal), None
    plan = await plan_turn(available(sessions), dispatcher, request, principal, request_id)
    return plan.prepared, plan


def with_session(sessions: SessionStore | None, plan: TurnPlan | None, chunks):
    return chunks if plan is None else committing(sessions, plan, chunks)


@contextlib.contextmanager
def released_on_error(sessions: SessionStore | None, plan: TurnPlan | None):
    """A session's turn, held between its planning and its stream, is given back if the request
    fails in between (admission refused it...)."""
    try:
        yield
    except BaseException:
        if plan is not None:
            sessions.release_later(plan.held)
        raise


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self, dispatcher: Dispatcher, authenticator: Authenticator, meter: Meter | None = None, read_usage=None,
        sessions: SessionStore | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._auth = authenticator
        self._meter = meter
        self._read_usage = read_usage
        self._sessions = sessions

    async def Generate(self, request: inference_pb2.GenerateRequest, context):
        arrived, arrived_wall = time.perf_counter(), time.time()
        principal = await admit_generation(self._auth, self._meter)
        tenant_s = time.perf_counter() - arrived
        note_client_id(request.request_id)
        request_id = current_request_id()
        prepared, plan = await prepare_one(self._dispatcher, self._sessions, request, principal, request_id)
        with released_on_error(self._sessions, plan):
            n = prepared.request.n or 1
            admitting = time.perf_counter()
            m = await admit_usage(self._meter, principal, [prepared], request_id, n * prepared.request.max_tokens,
                                  arrived, request.session_id)
            tenant_s += time.perf_counter() - admitting + (plan.tenant_s if plan else 0.0)
        ingress_s = latency.ingress_seconds(dict(context.invocation_metadata() or ()), arrived_wall)
        chunks = self._dispatcher.stream(prepared, principal, request_id, context.time_remaining(), arrived, tenant_s,
                                         ingress_s, on_abandoned=m.abandoned.append if m is not None else None)
        async for chunk in metered(self._meter, m, with_session(self._sessions, plan, chunks),
                                   on_last=lambda c: self._dispatcher.observe_latency(c.timings, principal.tier)):
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

    async def GetUsage(self, request: inference_pb2.GetOwnUsageRequest, context) -> billing_pb2.UsageReport:
        principal = await admit(self._auth)
        if self._read_usage is None:
            raise errors.Unimplemented("usage is not available on this router")
        if request.by and request.by not in metering.USAGE_GROUPS:
            raise errors.InvalidArgument("by must be model, day or key (or empty for the total only)", param="by")
        now = metering.now_ms()
        start = metering.parse_time(request.since, "since", now)
        end = metering.parse_time(request.until, "until", now)
        if end and end <= start:
            raise errors.InvalidArgument("until must be after since", param="until")
        return await self._read_usage(principal.tenant, start, end, request.by)

    # ------------------------------------------------------------ sessions (the caller's own only)

    async def ListSessions(self, request: inference_pb2.ListSessionsRequest, context) -> inference_pb2.ListSessionsResponse:
        return await list_response(self._sessions, (await admit(self._auth)).tenant, request.limit)

    async def GetSession(self, request: inference_pb2.GetSessionRequest, context) -> inference_pb2.Session:
        return await get_response(self._sessions, (await admit(self._auth)).tenant, request.session_id)

    async def DeleteSession(self, request: inference_pb2.DeleteSessionRequest, context) -> inference_pb2.DeleteSessionResponse:
        return await delete_response(self._sessions, (await admit(self._auth)).tenant, request.session_id)
