"""gaas.v1.Control's deployment methods: protobuf <-> the deployment (services/control/deployment.py)
and its roll-outs, nothing more. ControlServicer (servicer.py) takes them in."""

from __future__ import annotations

import hashlib
import json
import logging
import time

from gaas.contracts import errors
from gaas.contracts.adapters import Adapter
from gaas.contracts.tenancy import TIER_TO_PB
from gaas.runtime.context import current_caller
from gaas.settings.deployspec import SpecError
from gaas.v1 import control_pb2 as pb
from services.control.adapters import AdapterStore, apply_checks
from services.control.catalog import ModelCatalog
from services.control.deployment import Deployment, Pool
from services.control.rollout.driver import Driver
from services.control.rollout.figures import Window

log = logging.getLogger(__name__)

# How long a read of the deployment serves ListModels and ListPools (every router and launcher
# asks about twice a second); a change made here is seen at once.
VIEW_SECONDS = 0.25
# A file applied at most this large.
MAX_FILE_BYTES = 1 << 20


def pool_to_pb(p: Pool) -> pb.Pool:
    s = p.spec
    out = pb.Pool(model=p.model, version=p.version, source=s["source"], preset=s.get("preset", ""),
                  seed=int(s.get("seed", 0)), max_model_len=int(s["max_model_len"]), replicas=str(s.get("replicas", 0)),
                  engine_json=json.dumps(s.get("engine") or {}, sort_keys=True), device=s.get("device", "any"),
                  tenants=list(s.get("tenants") or ()), role=p.role,
                  device_needs_json=json.dumps(s.get("device_needs") or {}, sort_keys=True))
    if (a := p.autoscale) is not None:
        out.autoscaled, out.min_replicas, out.max_replicas, out.scale_reason = True, a.min, a.max, p.reason
    return out


def adapter_to_pb(a: Adapter) -> pb.Adapter:
    out = pb.Adapter(name=a.name, base_model=a.base_model, path=a.path, rank=a.rank, owner=a.owner, public=a.public,
                     adapter_id=a.adapter_id, created_unix_ms=a.created_ms)
    if a.price is not None:
        out.price_input, out.price_cached_input, out.price_output = a.price.input, a.price.cached_input, a.price.output
    return out


class DeploymentRpcs:
    """The deployment's methods of gaas.v1.Control (a mixin: ControlServicer sets the attributes)."""

    _deployment: Deployment
    _catalog: ModelCatalog
    _driver: Driver | None
    _adapters: AdapterStore | None

    async def _adapter_list(self) -> list[Adapter]:
        """The catalogued LoRA adapters (read at most every VIEW_SECONDS: ListModels and each
        worker's lease renewal carry them)."""
        async def read() -> list[Adapter]:
            return await self._adapters.list() if self._adapters is not None else []

        return await self._cached("adapters", read)

    def _deployment_changed(self) -> None:
        self._views = {}
        self._generation = getattr(self, "_generation", 0) + 1
        if self._driver is not None:
            self._driver.poke()

    async def _cached(self, what: str, make):
        views = getattr(self, "_views", None)
        if views is None:
            views = self._views = {}
        hit = views.get(what)
        if hit is not None and time.monotonic() - hit[0] < VIEW_SECONDS:
            return hit[1]
        generation = getattr(self, "_generation", 0)
        value = await make()
        if generation == getattr(self, "_generation", 0):  # (a read a change overtook is not kept)
            self._views[what] = (time.monotonic(), value)
        return value

    async def ListModels(self, request: pb.ListRegisteredModelsRequest, context) -> pb.ListRegisteredModelsResponse:
        return await self._cached("models", self._models)

    async def _models(self) -> pb.ListRegisteredModelsResponse:
        models = {m.name: m for m in await self._catalog.list()}
        prices = await self._catalog.prices()
        served = {s.model.name: s for s in await self._deployment.served()}
        adapters: dict[str, list] = {}
        for a in await self._adapter_list():
            adapters.setdefault(a.base_model, []).append(adapter_to_pb(a))
        out = []
        for name, m in models.items():
            entry = pb.RegisteredModel(
                name=m.name, version=m.version, source=m.source, preset=m.preset, max_model_len=m.max_model_len,
                is_default=m.is_default, replicas=str(m.replicas),
                prices=[pb.TierPrice(tier=TIER_TO_PB[t], input=p.input, cached_input=p.cached_input, output=p.output)
                        for t, p in prices.get(m.name, {}).items()],
                adapters=adapters.get(m.name, ()),
            )
            s = served.get(name)
            if s is not None:
                entry.replicas = str(s.model.replicas)
                entry.autoscaled = any(pool.get("autoscale") for pool in s.versions.values())
                stable_pool = s.versions.get(m.version) or next(iter(s.versions.values()), {})
                entry.task = (stable_pool.get("engine") or {}).get("task", "")
                for version, pool in s.versions.items():
                    entry.versions.append(pb.ModelVersion(version=version, source=pool["source"],
                                                          max_model_len=int(pool["max_model_len"]),
                                                          tenants=list(pool.get("tenants") or ()),
                                                          role=s.roles[version]))
                sp = s.split
                entry.split.CopyFrom(pb.VersionSplit(stable=sp.stable, canary=sp.canary, weight=sp.weight,
                                                     shadow=sp.shadow, pins=dict(sp.pins), kept=list(sp.kept)))
            out.append(entry)
        return pb.ListRegisteredModelsResponse(models=out)

    async def ListPools(self, request: pb.ListPoolsRequest, context) -> pb.ListPoolsResponse:
        return await self._cached("pools", self._pools)

    async def _pools(self) -> pb.ListPoolsResponse:
        view = await self._deployment.view()
        pools = [pool_to_pb(p) for p in await self._deployment.pools(view)]
        digest = hashlib.sha256(b"".join(p.SerializeToString(deterministic=True) for p in pools)).hexdigest()[:16]
        return pb.ListPoolsResponse(pools=pools, version=digest)

    async def ApplyDeployment(self, request: pb.ApplyDeploymentRequest, context) -> pb.ApplyDeploymentResponse:
        if len(request.text.encode()) > MAX_FILE_BYTES:
            raise errors.InvalidArgument(f"the deployment file is over {MAX_FILE_BYTES >> 10} KiB", param="text")
        if request.file and not request.file.startswith("/"):
            raise errors.InvalidArgument("file must be the deployment file's absolute path (what relative sources are "
                                         "relative to)", param="file")
        origin = request.origin[:200] or "ApplyDeployment"
        try:
            # (a file that would take a catalogued LoRA adapter's name, or leave one unservable, is refused)
            adapters = await self._adapters.list() if self._adapters is not None else []
            number, changes = await self._deployment.apply_file(request.text, request.file, origin, request.dry_run,
                                                                check=apply_checks(adapters))
        except SpecError as exc:
            raise errors.InvalidArgument(str(exc), param="text") from None
        if number:
            self._deployment_changed()
        return pb.ApplyDeploymentResponse(revision=number, changes=[
            pb.DeploymentChange(subject=c.subject, kind=c.kind, detail=c.detail) for c in changes])

    async def ListRevisions(self, request: pb.ListRevisionsRequest, context) -> pb.ListRevisionsResponse:
        return pb.ListRevisionsResponse(revisions=[
            pb.Revision(number=r["number"], applied_unix_ms=r["applied_ms"], origin=r["origin"], changes=r["changes"],
                        digest=r["digest"])
            for r in await self._deployment.revisions(request.model)])

    async def ReportPoolFailure(self, request: pb.ReportPoolFailureRequest, context) -> pb.ReportPoolFailureResponse:
        caller = current_caller()
        if caller is not None and caller.kind == "worker" and caller.name != request.worker_id:
            raise errors.PermissionDenied("a worker reports its own failures only")
        if not request.model or not request.version or not request.reason:
            raise errors.InvalidArgument("model, version and reason are required")
        log.warning("%s %s cannot start%s: %s", request.model, request.version,
                    f" ({request.worker_id})" if request.worker_id else "", request.reason)
        await self._deployment.report_failure(request.model, request.version, request.reason, request.worker_id)
        self._deployment_changed()
        return pb.ReportPoolFailureResponse()

    async def GetRollout(self, request: pb.GetRolloutRequest, context) -> pb.RolloutStatus:
        r, _ = await self._deployment.rollout(request.model)
        if r is None:
            if request.model not in {m.name for m in await self._catalog.list()}:
                raise errors.NotFound(f"model {errors.quote(request.model)} is not deployed; `gaas models` lists them",
                                      param="model")
            raise errors.NotFound(f"{request.model} has had no roll-out; change its version and `gaas apply` the "
                                  "file to start one", param="model")
        return self._status(r)

    async def ChangeRollout(self, request: pb.ChangeRolloutRequest, context) -> pb.RolloutStatus:
        r = await self._deployment.change(request.model, request.action, int(request.to_revision))
        self._deployment_changed()
        log.info("%s's roll-out: %s by the operator (%s)", request.model, request.action, r.state)
        return self._status(r)

    def _status(self, r) -> pb.RolloutStatus:
        window = (self._driver.window(r.model) if self._driver is not None else None) or Window(r.policy.guard.window_s)
        return pb.RolloutStatus(json=json.dumps(r.status(time.time(), window)))
