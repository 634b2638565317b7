"""What the router knows of the mesh: models and live workers (with their latest load reports)
from the control plane, refreshed in the background so no request waits for it, and workers
recently seen failing (skipped for a while)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

from gaas.contracts import adapters as adapter_names, errors
from gaas.contracts.adapters import Adapter
from gaas.contracts.tenancy import TIERS
from gaas.contracts.pricing import Price
from gaas.contracts.rollout import Split
from gaas.contracts.tasks import GENERATE
from services.router.scheduling.types import Candidate

log = logging.getLogger(__name__)

# A view younger than this is not fetched again on a miss (a burst of requests for a model with no
# worker must not hammer the control plane).
FRESH_SECONDS = 0.1


@dataclass(frozen=True, slots=True)
class VersionEntry:
    """One version of a model that has workers."""

    # Local directory of its weights and tokenizer (the router reads the tokenizer there).
    source: str
    max_model_len: int
    # stable, canary or kept.
    role: str = "stable"


# What /v1/models says of a model: workers serve it; they are starting; its autoscaler starts one
# on its first request. A model in none of these states (catalogued, no workers) is not listed.
READY, STARTING, SCALED_TO_ZERO = "ready", "starting", "scaled_to_zero"


def model_state(model: "ModelEntry", ready_workers: int) -> str:
    """READY, STARTING, SCALED_TO_ZERO, or "" for a model that nothing serves or will."""
    if ready_workers:
        return READY
    if model.wants_workers:
        return STARTING
    return SCALED_TO_ZERO if model.autoscaled else ""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """A model: its stable version (or, from at(), the version a request was given) and the
    others that serve, with how new requests are split between them."""

    name: str
    version: str
    max_model_len: int
    is_default: bool
    # Local directory of the weights and tokenizer (the router reads the tokenizer there).
    source: str = ""
    # Public prefixes: (prefix id, text) of prompt beginnings every tenant shares in the cache.
    public_prefixes: tuple[tuple[str, str], ...] = ()
    # Tier -> what its tokens cost (gaas.contracts.pricing.Price); a tier not listed pays nothing.
    prices: Mapping[str, Price] = field(default_factory=dict)
    # Version -> its entry, for every version with workers (empty: the one version above).
    versions: Mapping[str, VersionEntry] = field(default_factory=dict)
    # How new requests are split between the versions (None: all to the version above).
    split: Split | None = None
    # Its pools scale on load: a request while no worker serves it waits for one to start.
    autoscaled: bool = False
    # The deployment gives it workers (replicas above 0): while none serves, they are starting.
    wants_workers: bool = False
    # Its LoRA adapters by name, and the one a request was resolved to (None: the base model).
    adapters: Mapping[str, Adapter] = field(default_factory=dict)
    adapter: Adapter | None = None
    # What it serves (gaas.contracts.tasks): generations, or a vector per input ("embed").
    task: str = GENERATE

    @property
    def served_name(self) -> str:
        """What answers name as their model: the adapter's name, else the model's."""
        return self.adapter.name if self.adapter is not None else self.name

    def with_adapter(self, adapter: Adapter) -> ModelEntry:
        """The model serving a request with adapter (at the adapter's prices, every tier's, where it
        has its own)."""
        prices = {tier: adapter.price for tier in TIERS} if adapter.price is not None else self.prices
        return replace(self, adapter=adapter, prices=prices)

    def at(self, version: str) -> ModelEntry:
        """The model as served by version (its weights, tokenizer and window)."""
        if version == self.version or version not in self.versions:
            return self
        v = self.versions[version]
        return replace(self, version=version, source=v.source, max_model_len=v.max_model_len)

    def role(self, version: str) -> str:
        """A version's part in the model's roll-out: stable, canary or kept (stable when control
        says nothing of it)."""
        v = self.versions.get(version)
        return v.role if v is not None else "stable"

    @property
    def pool(self) -> str:
        """The version whose workers may take its requests ("": any of the model's, when control
        sends no split)."""
        return self.version if self.split is not None else ""

    @property
    def rolling_out(self) -> bool:
        """Whether a new version is being rolled out (its requests' outcomes are reported)."""
        return self.split is not None and bool(self.split.canary)


@dataclass(slots=True)
class Snapshot:
    models: list[ModelEntry]
    workers: list[Candidate]
    taken_at: float


class MeshDirectory:
    """fetch() returns (models, serving workers). A background task (run()) refreshes them every
    refresh_seconds; a request only fetches itself when the view is missing or older than
    max_stale_seconds (the control plane was unreachable that long)."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[tuple[list[ModelEntry], list[Candidate]]]],
        refresh_seconds: float,
        max_stale_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_refresh: Callable[[Snapshot], None] | None = None,
    ) -> None:
        self._fetch = fetch
        # Told each new view (the flow forgets the windows and breakers of workers that left).
        self._on_refresh = on_refresh
        self._refresh = refresh_seconds
        self._max_stale = max_stale_seconds
        self._clock = clock
        self._snapshot: Snapshot | None = None
        self._lock = asyncio.Lock()
        self._viewed = asyncio.Event()

    async def _refresh_now(self) -> Snapshot:
        async with self._lock:
            models, workers = await self._fetch()
            self._snapshot = Snapshot(models, workers, self._clock())
            self._viewed.set()
            if self._on_refresh is not None:
                self._on_refresh(self._snapshot)
            return self._snapshot

    async def refresh(self) -> None:
        """Read the view again now (the registry changed)."""
        await self._refresh_now()

    async def run(self) -> None:
        """Refresh the view until cancelled (failures keep the last view and are logged once)."""
        failing = False
        while True:
            try:
                await self._refresh_now()
                if failing:
                    log.info("the control plane answers again")
                failing = False
            except errors.GaasError as exc:
                if not failing:
                    log.warning("cannot refresh the view of the mesh (%s); routing on the last one for up to %.0f s",
                                exc, self._max_stale)
                failing = True
            await asyncio.sleep(self._refresh)

    async def first_view(self) -> None:
        """Returns once a view has been read (run() reads it): a router that cannot see the mesh
        cannot route, nor, with control away, verify a key it has not seen."""
        await self._viewed.wait()

    @property
    def latest(self) -> Snapshot | None:
        """The view as it stands, without fetching (None before the first)."""
        return self._snapshot

    async def snapshot(self) -> Snapshot:
        snap = self._snapshot
        if snap is not None and self._clock() - snap.taken_at < self._max_stale:
            return snap
        return await self._refresh_now()

    async def _fresh_if(self, missing: bool) -> Snapshot | None:
        """A fresh view when what the current one lacks may be news (a worker that just
        registered, a model just applied) and the current one is not brand new; else None."""
        snap = self._snapshot
        if missing and (snap is None or self._clock() - snap.taken_at > FRESH_SECONDS):
            try:
                return await self._refresh_now()
            except errors.GaasError:
                if snap is None:
                    raise
        return None

    async def resolve_model(self, name: str, tenant: str | None = None) -> ModelEntry:
        """The named model; when name is empty, the deployment's default if a worker serves it, else
        the first model one serves (a mesh started with another model answers with that one).
        tenant: whose request it is, which may name one of the LoRA adapters it may use
        (gaas.contracts.adapters): "base:adapter" or the adapter's own name (None: no adapters)."""
        snap = await self.snapshot()
        models = snap.models
        if name and self._find(models, name, tenant) is None and (fresh := await self._fresh_if(True)) is not None:
            snap, models = fresh, fresh.models
        if not models:
            raise errors.NotFound("no models are deployed; apply a deployment file to the control plane", param="model")
        if not name:
            served = {w.model for w in snap.workers}
            return min(models, key=lambda m: (m.name not in served, not m.is_default))
        found = self._find(models, name, tenant)
        if found is None:
            raise adapter_names.not_found(name, [m.name for m in models])
        return found

    @staticmethod
    def _find(models: list[ModelEntry], name: str, tenant: str | None) -> ModelEntry | None:
        base, adapter = adapter_names.split_name(name)
        for m in models:
            if m.name == base and not adapter:
                return m
            if tenant is None:
                continue
            a = m.adapters.get(adapter or name)
            if a is not None and (not adapter or m.name == base) and a.may_use(tenant):
                return m.with_adapter(a)
        return None

    async def workers(self, model: str, version: str = "") -> list[Candidate]:
        """The serving workers of model (of that version, when given); errors.Unavailable when
        there are none."""

        def of(workers: list[Candidate]) -> list[Candidate]:
            return [w for w in workers if w.model == model and (not version or w.model_version == version)]

        serving = of((await self.snapshot()).workers)
        if not serving and (fresh := await self._fresh_if(True)) is not None:
            serving = of(fresh.workers)
        if not serving:
            which = f"{model!r} {version}" if version else repr(model)
            state = await self.state(model)
            if state == STARTING:
                raise errors.Unavailable(f"no worker serves {which} yet: its workers are starting (vLLM loads the "
                                         "model); retry in a few seconds", retry_after=5.0)
            if state == "" and not version:
                raise errors.Unavailable(f"{which} is deployed with no workers (replicas: 0); the mesh's operator "
                                         "gives it some in the deployment file and runs `gaas apply`; GET /v1/models "
                                         "lists the models serving now")
            raise errors.Unavailable(f"no worker is serving {which} right now; retry in a few seconds")
        return serving

    async def state(self, model: str) -> str:
        """What the deployment says of model while no worker of it serves (model_state)."""
        entry = next((m for m in (await self.snapshot()).models if m.name == model), None)
        return model_state(entry, 0) if entry is not None else ""

    async def serving(self) -> list[tuple[ModelEntry, int, dict[str, int]]]:
        """The deployed models, each with how many serving workers it has now, in all and by version."""
        snap = await self.snapshot()
        ready: dict[str, dict[str, int]] = {}
        for w in snap.workers:
            by_version = ready.setdefault(w.model, {})
            by_version[w.model_version] = by_version.get(w.model_version, 0) + 1
        return [(m, sum(ready.get(m.name, {}).values()), ready.get(m.name, {})) for m in snap.models]

    async def engine_version(self) -> str:
        """The engine version the serving workers report (one of them, should they differ)."""
        versions = sorted({w.engine_version for w in (await self.snapshot()).workers if w.engine_version})
        return versions[0] if versions else "unknown"

    def versions_serving(self, model: str) -> set[str]:
        """The versions of model with a serving worker in the current view."""
        snap = self._snapshot
        return {w.model_version for w in snap.workers if w.model == model} if snap else set()


class DirectoryCollector:
    """Prometheus figures of the router's view of the mesh, read at each scrape (never a fetch):
    each serving worker's last load report and how old the view is."""

    GAUGES = (
        ("worker_running_requests", "Requests running in each worker's engine, as it last reported", "running"),
        ("worker_waiting_requests", "Requests waiting in each worker's engine, as it last reported", "waiting"),
        ("worker_kv_cache_usage", "Share of each worker's KV-cache blocks in use (0..1)", "kv_usage"),
        ("worker_device_memory_used_bytes", "Device memory each worker uses (its GPU's, or the host's RAM)",
         "memory_used"),
        ("worker_device_utilization", "Busy share of each worker's device (0..1)", "utilization"),
    )

    def __init__(self, directory: MeshDirectory, clock: Callable[[], float] = time.monotonic,
                 prefix: str = "gaas_router") -> None:
        self._directory = directory
        self._clock = clock
        self._prefix = prefix

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        snap = self._directory.latest
        families = []
        for name, doc, attr in self.GAUGES:
            g = GaugeMetricFamily(f"{self._prefix}_{name}", doc, labels=["worker", "model"])
            for w in snap.workers if snap else ():
                g.add_metric([w.worker_id, w.model], getattr(w.load, attr))
            families.append(g)
        age = GaugeMetricFamily(f"{self._prefix}_mesh_view_age_seconds",
                                "Age of the router's view of the mesh (workers, models, loads)")
        if snap is not None:
            age.add_metric([], max(0.0, self._clock() - snap.taken_at))
        families.append(age)
        yield from families
