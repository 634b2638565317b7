"""One generation's way through the router, for every front that serves one: the native gRPC API
(servicer.py), the OpenAI routes (openai_servicer.py) and the ingress's decision on the direct path
(extproc.py). An adapter translates its wire format into engine requests and the chunks back into
its answers; everything between is here, in this order (the stages as docs/architecture.md numbers
them):

  1. authenticate  the caller's key; its tenant refused at once, before its body is even parsed,
                   when this router's own count says it cannot be admitted (Meter.precheck)
  2. parse         (the adapter's) its body into engine requests, one per prompt
  3. prepare       each prompt resolved to its model, tokenized and checked (prepare.Preparer), and
                   what the adapter's own API limits (an OpenAI answer's size); a session's turn
                   with its stored context before it, the session then held
  4. admit         the tenant's quotas and budget checked, the request's most possible cost reserved
                   (gaas.metering.meter: one Redis script, shared by every router replica)
  5. place         the scheduler's pick within the batching windows (placement.Placer); on the
                   direct path the request is only placed, and the worker streams and meters it
  6. stream        the worker's stream relayed (relay.Relay), a session's reply committed before
                   its last chunk
  7. meter         one usage event before the last chunk is released, its latency decomposition observed

A failure at any stage gives back what the stages before it took (a session's turn, a reservation)
and is raised as a gaas.contracts.errors error, which the adapter's server interceptor answers.
One Timing per request measures where its time went; the latency decomposition is built from it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from gaas.contracts import errors, latency
from gaas.contracts.pricing import FREE
from gaas.metering.meter import Meter, Metered, metered
from gaas.runtime.context import client_request_id_var, current_authorization, current_request_id, \
    sanitize_client_id, tenant_var
from gaas.v1 import common_pb2, inference_pb2
from services.router.auth import Authenticator, Principal
from services.router.stages import Stages
from services.router.placement import DirectPlacement
from services.router.prepare import Prepared
from gaas.runtime.streams import merge
from services.router.sessions import SessionStore, TurnPlan, available, check_turn, committing, plan_turn


@dataclass(slots=True)
class Timing:
    """One request's clock in the router: its arrival (perf_counter, and the wall clock the ingress's
    hop is measured against) and the time spent on the tenant's account (the key check, admission,
    the session), which the latency decomposition reports apart from the router's own time."""

    arrived: float = field(default_factory=time.perf_counter)
    arrived_wall: float = field(default_factory=time.time)
    tenant_s: float = 0.0

    @contextmanager
    def on_tenant(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.tenant_s += time.perf_counter() - started

    def ingress_s(self, metadata: Mapping[str, str]) -> float:
        """The hop from the ingress to this router (0 when the ingress did not stamp the request)."""
        return latency.ingress_seconds(metadata, self.arrived_wall)


@dataclass(slots=True)
class Generation:
    """A request through stage 4 (admit): each prompt ready for a worker."""

    principal: Principal
    request_id: str
    prepared: list[Prepared]
    timing: Timing
    session_id: str = ""
    # A session's turn, held from its planning until its stream ends (or the request fails).
    plan: TurnPlan | None = None
    # Its usage record (None: this router meters nothing).
    metered: Metered | None = None
    # The share of its tier's price it is billed at (a batch item's: gaas.contracts.batches).
    price_factor: float = 1.0

    @property
    def max_tokens(self) -> int:
        """The most tokens it can generate, every choice of every prompt."""
        return sum((p.request.n or 1) * p.request.max_tokens for p in self.prepared)


def note_client_id(client_id: str) -> None:
    """The id a client gave in its request body, for the logs (the x-request-id header wins)."""
    if client_id and not client_request_id_var.get():
        client_request_id_var.set(sanitize_client_id(client_id))


class Pipeline:
    def __init__(self, stages: Stages, authenticator: Authenticator, meter: Meter | None = None,
                 sessions: SessionStore | None = None) -> None:
        self.stages = stages
        self.meter = meter
        self.sessions = sessions
        self._auth = authenticator

    # ------------------------------------------------------------ 1. authenticate

    async def caller(self, client: str = "") -> Principal:
        """The caller's Principal (errors.Unauthenticated, or Unavailable when the control plane
        cannot be asked), for any call. client: its address, where the ingress's key check is
        this call's (unknown keys count against it). Sets the tenant the rest of the mesh sees."""
        principal = await self._auth.authenticate(current_authorization(), client)
        tenant_var.set(principal.tenant)  # carried to the workers as x-gaas-tenant
        return principal

    async def authenticate(self, timing: Timing, client: str = "") -> Principal:
        """caller() for a generation (or a count against its tenant's quotas): refused at once when
        this router's own count says the tenant is over its sequences at once or its requests a
        minute, before the body is parsed, a session read or a prompt tokenized."""
        with timing.on_tenant():
            principal = await self.caller(client)
            if self.meter is not None:
                self.meter.precheck(principal)
        return principal

    # ------------------------------------------------------------ 3-4. prepare, admit

    async def start(
        self, principal: Principal, requests: list[inference_pb2.GenerateRequest], timing: Timing, *,
        check: Callable[[list[Prepared]], None] | None = None, direct: bool = False, price_factor: float = 1.0,
    ) -> Generation:
        """Prepare every prompt (a session's turn with its context: a request naming its session),
        run the adapter's check on them, and admit the request. Every prompt is checked and
        tokenized before anything is generated. direct: a worker will stream it (place_direct)."""
        request_id = current_request_id()
        if len(requests) > 1 and any(r.session_id for r in requests):
            raise errors.InvalidArgument("a session turn is one prompt, not a batch", param="prompt")
        plan = None
        if len(requests) == 1 and check_turn(requests[0]):
            plan = await plan_turn(available(self.sessions), self.stages.preparer, requests[0], principal, request_id,
                                   for_ingress=direct)
            prepared = [plan.prepared]
            timing.tenant_s += plan.tenant_s
        else:
            prepared = [await self.stages.preparer.prepare(r, principal, for_ingress=direct) for r in requests]
        g = Generation(principal, request_id, prepared, timing, plan.held.session_id if plan else "", plan,
                       price_factor=price_factor)
        try:
            if check is not None:
                check(prepared)
            with timing.on_tenant():
                g.metered = await self._admit(g, direct)
        except BaseException:
            if plan is not None:
                self.sessions.release_later(plan.held)
            raise
        if plan is None and len(requests) == 1:
            # While the model's new version shadows, a share of its requests is copied to it.
            self.stages.shadow.maybe_copy(requests[0], principal, prepared[0].model, request_id)
        return g

    async def _admit(self, g: Generation, direct: bool = False) -> Metered | None:
        """The tenant's quotas and budget checked, and the request's place, its prompt tokens, the
        most it can generate and its most possible cost reserved."""
        if self.meter is None:
            return None
        model = g.prepared[0].model
        price = model.prices.get(g.principal.tier, FREE)
        m = await self.meter.admit(
            g.principal, g.request_id, model.name, model.version,
            price if g.price_factor == 1.0 else price.scaled(g.price_factor),
            sum(p.prompt_tokens for p in g.prepared), g.max_tokens, len(g.prepared), client_request_id_var.get(),
            g.timing.arrived, sequences=sum(p.request.n or 1 for p in g.prepared), direct=direct,
        )
        m.session_id = g.session_id
        m.adapter = model.adapter.name if model.adapter is not None else ""
        return m

    # ------------------------------------------------------------ 5-7. place, stream and meter

    def stream(self, g: Generation, time_remaining: float | None,
               metadata: Mapping[str, str]) -> AsyncIterator[tuple[int, common_pb2.GenerateChunk]]:
        """(which prompt, chunk) of every prompt's stream as they come, the last one released once
        the request's usage is recorded; a session's reply committed before its last chunk."""
        ingress_s = g.timing.ingress_s(metadata)
        on_abandoned = g.metered.abandoned.append if g.metered is not None else None
        streams = []
        for i, p in enumerate(g.prepared):
            request_id = g.request_id if len(g.prepared) == 1 else f"{g.request_id}-{i}"
            chunks = self.stages.relay.stream(p, g.principal, request_id, time_remaining, g.timing.arrived,
                                              g.timing.tenant_s, ingress_s, on_abandoned)
            streams.append(chunks if g.plan is None else committing(self.sessions, g.plan, chunks))
        return metered(self.meter, g.metered, merge(streams), chunk_of=lambda pair: pair[1],
                       on_last=lambda c: self.stages.outcomes.observe_latency(c.timings, g.principal.tier))

    async def place_direct(self, g: Generation) -> DirectPlacement:
        """Stage 5 of the direct path: the request placed on a worker, which the ingress then sends
        it to (a prompt list whole, its prompts' engine requests beside the first); its reservation
        and its session's turn given back if it cannot be placed."""
        try:
            p = await self.stages.placer.place_direct(g.prepared[0], g.principal, g.request_id, None)
        except BaseException:
            if g.metered is not None:
                await self.meter.release(g.metered)
            if g.plan is not None:
                self.sessions.release_later(g.plan.held)
            raise
        if len(g.prepared) > 1:
            p.requests = [self.stages.placer.worker_request(pp, g.principal, f"{g.request_id}-{i}")
                          for i, pp in enumerate(g.prepared)]
        return p

    # ------------------------------------------------------------ counting without generating

    async def counted(self, principal: Principal, model_name: str, version: str, most_tokens: int,
                      timing: Timing) -> Metered | None:
        """A request that is counted against its tenant's quotas but not billed (/tokenize): its
        place and the most tokens it can hold reserved; settle it with settle()."""
        if self.meter is None:
            return None
        return await self.meter.admit(principal, current_request_id(), model_name, version, FREE, most_tokens, 0, 1,
                                      client_request_id_var.get(), timing.arrived)

    def settle(self, m: Metered | None, used_tokens: int) -> None:
        if m is not None:
            self.meter.release_later(m, used_tokens)
