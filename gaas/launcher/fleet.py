"""Which workers a mesh on one machine runs: the control plane's pools (each a model version with
its replicas, engine settings and device), reconciled with the workers running. Pure: the pools and
the workers come in, what to start and what to stop go out; gaas/launcher/mesh.py does it.

A pool's `replicas: auto` is the topology's auto_workers (one per GPU on a GPU host, one on a CPU
host, `gaas up --workers N`). A worker serves one pool for its life: a pool that shrinks or goes
away loses its highest-numbered workers (they drain), and new workers take the lowest free
numbers, so worker-N always has worker-N's ports."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# The keys of a worker instance's options that say which pool it serves (the rest are its engine
# settings, gaas.settings.worker.TOPOLOGY_OPTIONS).
POOL_KEYS = ("model", "version", "source", "preset", "seed", "max_model_len", "device")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One model version's workers, as control's ListPools gives them."""

    model: str
    version: str
    source: str
    preset: str = ""
    seed: int = 0
    max_model_len: int = 2048
    # A number, or "auto".
    replicas: int | str = 1
    engine: Mapping[str, object] = field(default_factory=dict)
    # any, cpu or gpu.
    device: str = "any"
    # stable, canary or kept.
    role: str = "stable"
    # What a device must offer beyond its kind (gaas.contracts.device; {}: nothing).
    device_needs: Mapping[str, object] = field(default_factory=dict)

    @property
    def requirement(self):
        from gaas.contracts.device import DeviceRequirement

        return DeviceRequirement.parse(dict(self.device_needs) or self.device)

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.version

    def count(self, auto: int) -> int:
        return auto if self.replicas == "auto" else int(self.replicas)

    def options(self) -> dict:
        """A worker instance's pool options (gaas.ops.topology.Topology.worker's pool)."""
        return {"model": self.model, "version": self.version, "source": self.source, "preset": self.preset,
                "seed": self.seed, "max_model_len": self.max_model_len, "device": self.device,
                "device_needs": dict(self.device_needs), "engine": dict(self.engine)}

    @classmethod
    def from_model(cls, m) -> PoolSpec:
        """A deployment file's model (gaas.settings.deployspec.ModelSpec) as its pool."""
        return cls(model=m.name, version=m.version, source=m.source, preset=m.preset, seed=m.seed,
                   max_model_len=m.max_model_len, replicas=m.replicas, engine=dict(m.engine), device=m.device,
                   device_needs=dict(m.device_needs))

    @classmethod
    def from_pb(cls, p) -> PoolSpec:
        replicas: int | str = p.replicas if p.replicas == "auto" else int(p.replicas or 0)
        return cls(model=p.model, version=p.version, source=p.source, preset=p.preset, seed=int(p.seed),
                   max_model_len=int(p.max_model_len), replicas=replicas,
                   engine=json.loads(p.engine_json or "{}"), device=p.device or "any", role=p.role or "stable",
                   device_needs=json.loads(p.device_needs_json or "{}"))


def key_of(options: Mapping[str, object]) -> tuple[str, str]:
    """The pool a worker instance serves, from its options."""
    return str(options.get("model", "")), str(options.get("version", ""))


@dataclass(frozen=True, slots=True)
class Running:
    """A worker the mesh runs: its number and the pool it serves."""

    index: int
    key: tuple[str, str]
    # Told to drain (it leaves once its streams are done).
    retiring: bool = False


@dataclass(slots=True)
class Actions:
    # (worker number, its pool), lowest numbers first.
    start: list[tuple[int, PoolSpec]] = field(default_factory=list)
    # Worker numbers to drain and stop.
    stop: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.start or self.stop)


def reconcile(pools: Iterable[PoolSpec], running: Iterable[Running], auto: int,
              placeable=lambda pool: True) -> Actions:
    """What to start and stop so the workers match the pools. placeable(pool): whether this host
    can run the pool's workers at all (its device); one that cannot gets none started."""
    pools = list(pools)
    running = list(running)
    out = Actions()
    want = {p.key: (p, p.count(auto) if placeable(p) else 0) for p in pools}
    taken = {r.index for r in running}
    for key in sorted({r.key for r in running} | set(want)):
        mine = sorted(r.index for r in running if r.key == key and not r.retiring)
        pool, n = want.get(key, (None, 0))
        if len(mine) > n:
            out.stop.extend(mine[n:][::-1])
        elif len(mine) < n and pool is not None:
            for _ in range(n - len(mine)):
                index = next(i for i in range(len(taken) + 1) if i not in taken)
                taken.add(index)
                out.start.append((index, pool))
    out.start.sort(key=lambda s: s[0])
    return out
