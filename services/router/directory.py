"""What the router knows of the mesh: models and live workers from the control plane, cached
briefly, and workers recently seen failing (skipped for a while)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gaas import errors
from services.router.picker import Candidate, WorkerId


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    version: str
    max_model_len: int
    is_default: bool
    # Local directory of the weights and tokenizer (the router reads the tokenizer there).
    source: str = ""


@dataclass(slots=True)
class Snapshot:
    models: list[ModelEntry]
    workers: list[Candidate]
    taken_at: float


class MeshDirectory:
    """fetch() returns (models, serving workers); results are reused for ttl seconds."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[tuple[list[ModelEntry], list[Candidate]]]],
        ttl_seconds: float,
        eject_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._ttl = ttl_seconds
        self._eject_seconds = eject_seconds
        self._clock = clock
        self._snapshot: Snapshot | None = None
        self._lock = asyncio.Lock()
        self._ejected: dict[WorkerId, float] = {}

    async def snapshot(self) -> Snapshot:
        snap = self._snapshot
        if snap is not None and self._clock() - snap.taken_at < self._ttl:
            return snap
        async with self._lock:
            snap = self._snapshot
            if snap is None or self._clock() - snap.taken_at >= self._ttl:
                models, workers = await self._fetch()
                snap = self._snapshot = Snapshot(models, workers, self._clock())
        return snap

    def invalidate(self) -> None:
        self._snapshot = None

    async def resolve_model(self, name: str) -> ModelEntry:
        """The named model, or the default one when name is empty."""
        models = (await self.snapshot()).models
        if not models:
            raise errors.NotFound("no models are deployed; apply a deployment file to the control plane", param="model")
        if not name:
            return next((m for m in models if m.is_default), models[0])
        for m in models:
            if m.name == name:
                return m
        raise errors.NotFound(
            f"model {errors.quote(name)} does not exist; available: {', '.join(m.name for m in models)}",
            param="model", reason="model_not_found",
        )

    async def candidates(self, model: str, exclude: set[WorkerId] = frozenset()) -> list[Candidate]:
        now = self._clock()
        workers = (await self.snapshot()).workers
        serving = [w for w in workers if w.model == model]
        if not serving:
            raise errors.Unavailable(f"no worker is serving {model!r} right now; retry in a few seconds")
        usable = [w for w in serving if w.worker_id not in exclude and self._ejected.get(w.worker_id, 0) <= now]
        if not usable:
            # Every worker failed recently: better to try them again than to refuse outright.
            usable = [w for w in serving if w.worker_id not in exclude]
        if not usable:
            raise errors.Unavailable(f"every worker serving {model!r} failed this request; retry shortly")
        return usable

    def eject(self, worker_id: WorkerId) -> None:
        """Skip worker_id for a while (it failed before producing a token)."""
        self._ejected[worker_id] = self._clock() + self._eject_seconds
        self.invalidate()
