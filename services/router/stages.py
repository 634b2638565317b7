"""The stages a generation goes through in the router, built once and shared by every API it
serves; services/router/pipeline.py calls each stage directly, in order:

  prepare.py    the model resolved, the prompt tokenized once and checked, its blocks looked up in the KV replica
  placement.py  the scheduler's pick within the batching windows (or a wait in the router's queue),
                what the worker is sent; on the direct path, the placement held until the worker's report
  relay.py      the worker's stream relayed, retried on another worker while no token has gone out
  outcomes.py   what is recorded of each request's outcome (metrics)
  shadow.py     a share of requests copied to a model's shadowing version

Stages also assembles the hooks around the scheduler's cycles (services/router/scheduling/hooks/):
the in-flight counts before a cycle, provisioning and the routed count after it, and the windows',
breakers' and prediction accounting after each response. Failures are gaas.contracts.errors, which
the server interceptor turns into statuses.
"""

from __future__ import annotations

from collections.abc import Callable

from gaas.contracts import qos
from gaas.model.tokenizer import Tokenizer
from gaas.v1 import worker_pb2_grpc
from services.router.activity import TenantActivity
from services.router.coalescing import Coalescing
from services.router.demand import Demand
from services.router.directory import MeshDirectory, ModelEntry
from services.router.flow import Flow
from services.router.kvclient import KVDirectoryClient
from services.router.outcomes import Outcomes, RolloutReporter, RouterMetrics
from services.router.placement import Inflight, Placer
from services.router.prepare import Preparer
from services.router.relay import Relay
from services.router.scheduling.hooks import Hooks
from services.router.scheduling.hooks.adapters_sent import AdaptersSent
from services.router.scheduling.hooks.flow_accounting import FlowAccounting
from services.router.scheduling.hooks.inflight import InflightSince
from services.router.scheduling.hooks.prediction import PredictionCheck
from services.router.scheduling.hooks.provision import Provision
from services.router.scheduling.hooks.routed import Routed
from services.router.shadow import Shadow

__all__ = ["Stages", "RouterMetrics"]


class Stages:
    """Each stage of a generation, wired to the mesh's view, the scheduler, the flow and the
    workers' channel (the router's server builds one)."""

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
        self.directory = directory
        self.activity = activity or TenantActivity()
        self.flow = flow or Flow(qos.DEFAULT_POLICIES)
        self.metrics = metrics
        self.outcomes = Outcomes(metrics, reporter)
        # Requests this router sent each worker (what the next load report cannot know yet).
        self.inflight = Inflight()
        adapters_sent = AdaptersSent()
        self.hooks = Hooks(
            pre=[InflightSince(self.inflight.since), adapters_sent],
            post=[adapters_sent, *([Provision(kv)] if kv is not None else []),
                  *([Routed(metrics.routed, scheduler.name)] if metrics.routed is not None else [])],
            response=[FlowAccounting(self.flow), PredictionCheck(self.outcomes.check_prediction)],
        )
        self.preparer = Preparer(directory, scheduler, tokenizer_for, kv, metrics.lookup_seconds, demand,
                                 lambda tier: self.flow.policy(tier).queue_timeout_s)
        self.placer = Placer(directory, scheduler, self.flow, self.hooks, self.inflight, metrics, self.outcomes,
                             self.activity, coalescing)
        self.relay = Relay(directory, self.placer, worker_stub, self.flow, self.hooks, self.inflight, metrics,
                           self.outcomes, self.activity, retries=retries, moves=moves,
                           max_stream_seconds=max_stream_seconds)
        self.shadow = Shadow(self.preparer, directory, scheduler, worker_stub, self.outcomes)

    @property
    def in_flight(self) -> int:
        """Requests streaming now (what /load reports)."""
        return self.inflight.total
