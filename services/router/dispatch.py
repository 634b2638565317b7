"""Taking a generation to a worker, in its stages (services/router/pipeline.py calls them):

  prepare.py    the model resolved, the prompt tokenized once and checked, its blocks looked up in the KV replica
  placement.py  the scheduler's pick within the batching windows (or a wait in the router's queue),
                what the worker is sent; on the direct path, the placement held until the worker's report
  relay.py      the worker's stream relayed, retried on another worker while no token has gone out
  outcomes.py   what is recorded of each request's outcome (metrics)

The Dispatcher is their one front: built once by the router's server with the mesh's view, the
scheduler, the flow and the worker channel, and shared by every API the router serves. It assembles
the hooks around the scheduler's cycles (services/router/scheduling/hooks/): the in-flight counts
before a cycle, provisioning and the routed count after it, and the windows',
breakers' and prediction accounting after each response. Failures are
gaas.contracts.errors, which the server interceptor turns into statuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from gaas.contracts import qos
from gaas.contracts.principal import Principal
from gaas.model.tokenizer import PromptPrefix, Tokenizer
from gaas.v1 import common_pb2, inference_pb2, worker_pb2_grpc
from services.router.activity import TenantActivity
from services.router.coalescing import Coalescing
from services.router.directory import MeshDirectory, ModelEntry
from services.router.flow import Flow
from services.router.kvclient import KVDirectoryClient
from services.router.outcomes import Outcomes, RolloutReporter, RouterMetrics
from services.router.placement import DirectPlacement, Inflight, Placer
from services.router.demand import Demand
from services.router.prepare import Prepared, Preparer
from services.router.relay import Relay
from services.router.scheduling.hooks import Hooks
from services.router.shadow import Shadow
from services.router.scheduling.hooks.adapters_sent import AdaptersSent
from services.router.scheduling.hooks.flow_accounting import FlowAccounting
from services.router.scheduling.hooks.inflight import InflightSince
from services.router.scheduling.hooks.prediction import PredictionCheck
from services.router.scheduling.hooks.provision import Provision
from services.router.scheduling.hooks.routed import Routed

__all__ = ["Dispatcher", "DirectPlacement", "Prepared", "RouterMetrics"]


class Dispatcher:
    def __init__(
        self,
        directory: MeshDirectory,
        scheduler,
        worker_stub: worker_pb2_grpc.WorkerStub,
        tokenizer_for: Callable[[ModelEntry], Tokenizer],
        *,
        retries: int,
        moves: int = 0,
        max_stream_seconds: float,
        kv: KVDirectoryClient | None = None,
        metrics: RouterMetrics = RouterMetrics(),
        flow: Flow | None = None,
        activity: TenantActivity | None = None,
        coalescing: Coalescing = Coalescing(),
        reporter: RolloutReporter | None = None,
        demand: Demand | None = None,
    ) -> None:
        self._directory = directory
        self.activity = activity or TenantActivity()
        self._flow = flow or Flow(qos.DEFAULT_POLICIES)
        self._metrics = metrics
        self._workers = worker_stub
        self.outcomes = Outcomes(metrics, reporter)
        self._inflight = Inflight()
        adapters_sent = AdaptersSent()
        self.hooks = Hooks(
            pre=[InflightSince(self._inflight.since), adapters_sent],
            post=[adapters_sent, *([Provision(kv)] if kv is not None else []),
                  *([Routed(metrics.routed, scheduler.name)] if metrics.routed is not None else [])],
            response=[FlowAccounting(self._flow), PredictionCheck(self.outcomes.check_prediction)],
        )
        self.preparer = Preparer(directory, scheduler, tokenizer_for, kv, metrics.lookup_seconds, demand,
                                 lambda tier: self._flow.policy(tier).queue_timeout_s)
        self.placer = Placer(directory, scheduler, self._flow, self.hooks, self._inflight, metrics, self.outcomes,
                             self.activity, coalescing)
        self.relay = Relay(directory, self.placer, worker_stub, self._flow, self.hooks, self._inflight, metrics,
                           self.outcomes, self.activity, retries=retries, moves=moves,
                           max_stream_seconds=max_stream_seconds)
        # Copies of a share of requests to a model's shadowing version.
        self.shadow = Shadow(self.preparer, directory, scheduler, worker_stub, self.outcomes)

    @property
    def flow(self) -> Flow:
        return self._flow

    @property
    def in_flight(self) -> int:
        """Requests streaming now (what /load reports)."""
        return self._inflight.total

    async def models(self) -> list[tuple[ModelEntry, int, dict[str, int]]]:
        """The deployed models, each with how many serving workers it has now, in all and by version."""
        snap = await self._directory.snapshot()
        ready: dict[str, dict[str, int]] = {}
        for w in snap.workers:
            by_version = ready.setdefault(w.model, {})
            by_version[w.model_version] = by_version.get(w.model_version, 0) + 1
        return [(m, sum(ready.get(m.name, {}).values()), ready.get(m.name, {})) for m in snap.models]

    async def engine_version(self) -> str:
        """The engine version the serving workers report (one of them, should they differ)."""
        versions = sorted({w.engine_version for w in (await self._directory.snapshot()).workers if w.engine_version})
        return versions[0] if versions else "unknown"

    # ------------------------------------------------------------ stage 3, prepare: prepare.py

    async def resolve_model(self, name: str, tenant: str | None = None) -> ModelEntry:
        return await self.preparer.resolve_model(name, tenant)

    async def tokenizer(self, model: ModelEntry) -> Tokenizer:
        return await self.preparer.tokenizer(model)

    async def tokenize(self, tok: Tokenizer, request: inference_pb2.GenerateRequest,
                       prefix: PromptPrefix | None = None) -> list[int]:
        return await self.preparer.tokenize(tok, request, prefix)

    async def prepare(self, request: inference_pb2.GenerateRequest, principal: Principal,
                      prefix: PromptPrefix | None = None, session_version: str = "", *,
                      for_ingress: bool = False) -> Prepared:
        return await self.preparer.prepare(request, principal, prefix, session_version, for_ingress=for_ingress)

    # ------------------------------------------------------------ stages 5-6, place and stream: placement.py, relay.py

    def stream(self, prepared: Prepared, principal: Principal, request_id: str, time_remaining: float | None,
               arrived: float, tenant_s: float = 0.0, ingress_s: float = 0.0,
               on_abandoned: Callable[[asyncio.Future], None] | None = None) -> AsyncIterator[common_pb2.GenerateChunk]:
        return self.relay.stream(prepared, principal, request_id, time_remaining, arrived, tenant_s, ingress_s,
                                 on_abandoned)

    async def place_direct(self, prepared: Prepared, principal: Principal, request_id: str,
                           time_remaining: float | None) -> DirectPlacement:
        return await self.placer.place_direct(prepared, principal, request_id, time_remaining)

    def worker_request(self, prepared: Prepared, principal: Principal, request_id: str):
        """What a worker is sent for a prepared request (placement.Placer.worker_request)."""
        return self.placer.worker_request(prepared, principal, request_id)

    def end_direct(self, p: DirectPlacement, code: grpc.StatusCode | None, detail: str,
                   final: common_pb2.GenerateChunk | None) -> None:
        self.placer.end_direct(p, code, detail, final)

    # ------------------------------------------------------------ stage 7, meter: outcomes.py

    def observe_latency(self, t: common_pb2.Timings, tier: str) -> None:
        self.outcomes.observe_latency(t, tier)
