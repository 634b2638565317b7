"""The mesh topology (deploy/topology.yaml): services, replicas and the ports every instance and
its Envoy sidecar listen on. The Envoy configs and `gaas up` are both derived from it.

Workers are the exception: how many there are, and which model version each serves, is the
deployment's (deploy/gaas.yaml's pools, applied live); the topology gives every worker its engine
settings' defaults and its port block. Workers take the blocks after every other instance's, one
per worker index (worker-0, worker-1...), so a worker started on a running mesh gets ports no other
instance has (Topology.worker)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from gaas.settings.common import HTTP_PORT_OFFSET, HTTP_SOCKET
from gaas.settings.worker import engine_options, topology_defaults

# Start order; also the order `gaas status` lists them.
SERVICES = ("control", "kvcache", "billing", "worker", "router")

# How a generation reaches its worker: through the router ("router", the default), or from the
# ingress straight to the worker the router picked there ("direct").
INGRESS_PATHS = ("router", "direct")

# Whom each kind calls, through its sidecar's outbound listener (DESIGN.md's "talks to").
TALKS_TO = {
    "control": (),
    "kvcache": ("control", "worker"),
    "billing": ("control",),
    "worker": ("control",),
    "router": ("control", "kvcache", "worker", "billing"),
}

# Who may call which method (each inbound sidecar's RBAC) is gaas/ops/access.py's table, the one
# definition of it.

PORTS_PER_INSTANCE = 10
SERVICE_OFFSET, INBOUND_OFFSET, OUTBOUND_OFFSET, ADMIN_OFFSET, METRICS_OFFSET = 0, 1, 2, 3, 4
# An Envoy's statistics for Prometheus (its admin's /stats/prometheus, nothing else of the admin).
ENVOY_STATS_OFFSET = 5
# Where a pod's listeners on the network bind: every address of the pod.
POD_BIND = "0.0.0.0"
# On a sidecar's statistics port in a pod: 200 while its service's gRPC health is SERVING, 503
# otherwise (the kubelet's readiness probe; Topology.pod).
READY_PATH = "/ready"
# In the ingress's block: where `gaas up --trace` receives spans over OTLP/gRPC (gaas.ops.tracesink).
TRACE_OFFSET = 6
# In a worker's block: its HTTP/1.1 front, where its sidecar sends the OpenAI generations the
# ingress streams from it (services/worker/http.py; on a host, a Unix socket beside its gRPC one).
HTTP_OFFSET = SERVICE_OFFSET + HTTP_PORT_OFFSET
# The ingress's Envoy processes under `gaas up` (ingress.replicas): they share the ingress port
# (SO_REUSEPORT: the kernel spreads new connections over them, and a new connection never reaches
# one that died), each its statistics at one of these offsets of the ingress's block.
INGRESS_STATS_OFFSETS = (ENVOY_STATS_OFFSET, 7, 8, 9)
DEFAULT_INGRESS_REPLICAS = 2

# A topology worker's options and their defaults are the worker's settings (gaas/settings/worker.py).
WORKER_DEFAULTS = topology_defaults()


class TopologyError(ValueError):
    """The topology file is malformed; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class Instance:
    # Service kind, one of SERVICES.
    service: str
    # Replica name, e.g. "worker-0".
    name: str
    # Replica index within its service.
    index: int
    host: str
    # First port of this instance's block.
    base: int
    # Service-specific settings (the worker's model, cache size...).
    options: Mapping[str, object] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.base + SERVICE_OFFSET

    @property
    def inbound_port(self) -> int:
        return self.base + INBOUND_OFFSET

    @property
    def outbound_port(self) -> int:
        return self.base + OUTBOUND_OFFSET

    @property
    def admin_port(self) -> int:
        return self.base + ADMIN_OFFSET

    @property
    def metrics_port(self) -> int:
        return self.base + METRICS_OFFSET

    @property
    def http_port(self) -> int:
        return self.base + HTTP_OFFSET

    @property
    def envoy_stats_port(self) -> int:
        return self.base + ENVOY_STATS_OFFSET

    @property
    def address(self) -> str:
        """The service's own port: only its sidecar connects here."""
        return f"{self.host}:{self.port}"

    @property
    def inbound(self) -> str:
        """Where peers (through their sidecars) reach this instance."""
        return f"{self.host}:{self.inbound_port}"

    @property
    def outbound(self) -> str:
        """Where this instance reaches its peers."""
        return f"{self.host}:{self.outbound_port}"


@dataclass(frozen=True, slots=True)
class LocalSockets:
    """Where a service and its sidecar meet when they share a host: Unix sockets in a directory
    only the mesh's owner may enter (0700), so no other local user or process reaches a service
    around its sidecar (loopback TCP is open to all of them)."""

    # The directory of this instance's two sockets.
    dir: Path
    # The service listens here; its sidecar's inbound listener forwards here.
    service: Path
    # The sidecar's outbound listener: where the service reaches its peers.
    outbound: Path
    # The Envoy's admin interface (readiness, draining, stats), never on a TCP port.
    admin: Path
    # A worker's HTTP/1.1 front (HTTP_OFFSET's socket): its sidecar forwards the OpenAI generations here.
    http: Path

    @classmethod
    def of(cls, root: Path, name: str) -> "LocalSockets":
        """Of an instance ("worker-0"), or of the ingress ("ingress-0": only its admin is used)."""
        d = root / name
        return cls(d, d / "service.sock", d / "outbound.sock", d / "admin.sock", d / HTTP_SOCKET)


# A Unix socket's path must fit in 108 bytes: a run directory deeper than this keeps its sockets
# under the temporary directory instead.
_MAX_SOCKETS_ROOT = 80


def sockets_root(run_dir: Path) -> Path:
    """Where the mesh of run_dir keeps its services' Unix sockets (one 0700 directory each)."""
    root = Path(run_dir) / "sockets"
    if len(str(root)) <= _MAX_SOCKETS_ROOT:
        return root
    digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"gaas-{os.getuid()}-{digest}"


@dataclass(frozen=True, slots=True)
class Topology:
    host: str
    port_base: int
    ingress_port: int
    instances: tuple[Instance, ...]
    # How generations reach their worker (INGRESS_PATHS): from the ingress straight to the worker
    # the router picked at the ingress, or through the router.
    ingress_path: str = "direct"
    # Instances in Kubernetes pods (gaas/k8s): each instance's host is its Service's name, which
    # peers dial, while its listeners on the pod network take every address of the pod; and each
    # sidecar health-checks its service and answers the kubelet's readiness probe (READY_PATH on
    # its statistics port) with what the service's gRPC health says.
    pod: bool = False
    # The ingress's Envoy processes on this host (ingress-0, ingress-1, ...), sharing its port.
    ingress_replicas: int = 1

    def bind(self, inst: "Instance | None" = None) -> str:
        """Where a listener on the network (an inbound or statistics listener, the ingress) binds."""
        if self.pod:
            return POD_BIND
        return inst.host if inst is not None else self.host

    @property
    def ingress_admin_port(self) -> int:
        return self.port_base + ADMIN_OFFSET

    @property
    def ingress_stats_port(self) -> int:
        return self.ingress_stats_port_of(0)

    def ingress_stats_port_of(self, replica: int) -> int:
        return self.port_base + INGRESS_STATS_OFFSETS[replica]

    @property
    def ingresses(self) -> list[str]:
        """The ingress's Envoys' names."""
        return [f"ingress-{i}" for i in range(self.ingress_replicas)]

    @property
    def trace_port(self) -> int:
        return self.port_base + TRACE_OFFSET

    @property
    def ingress(self) -> str:
        return f"{self.host}:{self.ingress_port}"

    def envoy_stats(self) -> dict[str, str]:
        """Each Envoy of the mesh (ingress-N, sidecar-<instance>) -> host:port of its statistics."""
        return {**{name: f"{self.host}:{self.ingress_stats_port_of(i)}" for i, name in enumerate(self.ingresses)},
                **{f"sidecar-{i.name}": f"{i.host}:{i.envoy_stats_port}" for i in self.instances}}

    # What a deployment pool's `replicas: auto` becomes (services.worker.replicas, or --workers),
    # and every worker's engine settings unless its pool says otherwise.
    auto_workers: int = 1
    worker_defaults: Mapping[str, object] = field(default_factory=dict)

    def of(self, service: str) -> list[Instance]:
        return [i for i in self.instances if i.service == service]

    @property
    def first_worker_block(self) -> int:
        """The port block of worker-0 (every other instance's blocks come before the workers')."""
        return 1 + sum(1 for i in self.instances if i.service != "worker")

    def worker(self, index: int, pool: Mapping[str, object] | None = None) -> Instance:
        """worker-<index>, serving pool (its model, version, source, max_model_len and engine
        settings, over the topology's defaults)."""
        pool = dict(pool or {})
        engine = dict(pool.pop("engine", None) or {})
        base = self.port_base + (self.first_worker_block + index) * PORTS_PER_INSTANCE
        if base + PORTS_PER_INSTANCE > 65536:
            raise TopologyError(f"port_base {self.port_base} leaves too few ports for worker-{index}'s port block")
        if base <= self.ingress_port < base + PORTS_PER_INSTANCE:
            raise TopologyError(f"worker-{index}'s port block ({base}-{base + PORTS_PER_INSTANCE - 1}) holds the "
                                f"ingress port {self.ingress_port}: run fewer workers, or move the ingress "
                                "(--ingress-port) or the port base (--port-base)")
        return Instance("worker", f"worker-{index}", index, self.host, base,
                        {**self.worker_defaults, **engine, **pool})

    def instance(self, name: str) -> Instance:
        for i in self.instances:
            if i.name == name:
                return i
        raise KeyError(f"no instance named {name!r} in the topology")

    def all_ports(self) -> list[int]:
        ports = [self.ingress_port, self.ingress_admin_port, self.trace_port,
                 *(self.ingress_stats_port_of(i) for i in range(self.ingress_replicas))]
        for i in self.instances:
            ports += [i.port, i.inbound_port, i.outbound_port, i.admin_port, i.metrics_port, i.envoy_stats_port]
        return ports

    def tcp_ports(self) -> list[int]:
        """The ports a mesh started by `gaas up` listens on (its services, outbound listeners and
        Envoy admin interfaces are Unix sockets): the ingress, each sidecar's inbound listener and
        each service's /metrics and each Envoy's statistics (and trace_port under `gaas up --trace`)."""
        return [self.ingress_port, *(self.ingress_stats_port_of(i) for i in range(self.ingress_replicas)),
                *(p for i in self.instances for p in (i.inbound_port, i.metrics_port, i.envoy_stats_port))]


def _int(value: object, what: str, minimum: int = 0) -> int:
    try:
        n = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TopologyError(f"{what} must be an integer, got {value!r}") from None
    if n < minimum:
        raise TopologyError(f"{what} must be at least {minimum}, got {n}")
    return n


def build(
    doc: Mapping[str, object],
    *,
    host: str | None = None,
    port_base: int | None = None,
    ingress_port: int | None = None,
    ingress_path: str | None = None,
    workers: int | str | None = None,
    auto_workers: int = 1,
    fleet: list[Mapping[str, object]] | None = None,
) -> Topology:
    """Derive every instance and port from the parsed YAML; keyword arguments override it.
    Worker replicas "auto" (the default) become auto_workers: the launcher passes one per GPU on a
    GPU host (gaas.host.devices), 1 on a CPU host; workers (--workers) overrides them. fleet: the
    pool of each worker, worker-0 first (the launcher's plan of the deployment)."""
    if not isinstance(doc, Mapping):
        raise TopologyError("the topology must be a mapping with host, port_base, ingress, services")
    services = doc.get("services") or {}
    if not isinstance(services, Mapping):
        raise TopologyError("'services' must map service names to their settings")
    unknown = set(services) - set(SERVICES)
    if unknown:
        raise TopologyError(f"unknown service(s) {', '.join(sorted(unknown))}; known: {', '.join(SERVICES)}")
    missing = set(SERVICES) - set(services)
    if missing:
        raise TopologyError(f"the mesh needs every service; missing: {', '.join(sorted(missing))}")

    host = host or str(doc.get("host", "127.0.0.1"))
    base = port_base if port_base is not None else _int(doc.get("port_base", 20000), "port_base", 1024)
    ingress = doc.get("ingress") or {}
    ingress_port = ingress_port if ingress_port is not None else _int(ingress.get("port", 8080), "ingress.port", 1)
    ingress_path = ingress_path or str(ingress.get("path", "direct"))
    if ingress_path not in INGRESS_PATHS:
        raise TopologyError(f"ingress.path must be one of {', '.join(INGRESS_PATHS)}, got {ingress_path!r}")
    ingress_replicas = _int(ingress.get("replicas", DEFAULT_INGRESS_REPLICAS), "ingress.replicas", 1)
    if ingress_replicas > len(INGRESS_STATS_OFFSETS):
        raise TopologyError(f"ingress.replicas can be at most {len(INGRESS_STATS_OFFSETS)} (Envoys sharing the "
                            f"ingress port on this host), got {ingress_replicas}")

    instances: list[Instance] = []
    block = 1  # block 0 is the ingress's; the workers' blocks come after every other instance's
    auto = auto_workers
    defaults: dict[str, object] = dict(WORKER_DEFAULTS)
    for service in SERVICES:
        settings = dict(services[service] or {})
        replicas = settings.pop("replicas", "auto" if service == "worker" else 1)
        if service == "worker":
            if workers is not None:
                replicas = workers
            if replicas == "auto":
                replicas = auto_workers
            what = "workers" if workers is not None else "services.worker.replicas"
            auto = _int(replicas, f"{what} (a number or auto)", 1)
            if "model" in settings:
                raise TopologyError("services.worker.model: the models served, and by how many workers, are the "
                                    "deployment's now (deploy/gaas.yaml: a model's replicas); remove it here")
            try:
                defaults.update(engine_options(settings))
            except ValueError as exc:
                raise TopologyError(f"services.worker: {exc}") from None
            continue
        if settings:
            raise TopologyError(f"services.{service}: unknown setting(s) {', '.join(sorted(settings))}")
        replicas = _int(replicas, f"services.{service}.replicas", 1)
        for idx in range(replicas):
            instances.append(Instance(service, f"{service}-{idx}", idx, host, base + block * PORTS_PER_INSTANCE))
            block += 1
    topo = Topology(host=host, port_base=base, ingress_port=ingress_port, instances=tuple(instances),
                    ingress_path=ingress_path, auto_workers=auto, worker_defaults=defaults,
                    ingress_replicas=ingress_replicas)
    # The workers: those of fleet (each a pool's worker), else auto_workers of no pool (what the
    # Envoy configs of a topology alone show).
    pools = list(fleet) if fleet is not None else [{}] * auto
    topo = with_workers(topo, [topo.worker(i, p) for i, p in enumerate(pools)])
    if base + (block + max(len(pools), 1)) * PORTS_PER_INSTANCE > 65535:
        raise TopologyError(f"port_base {base} leaves too few ports for {block + len(pools)} port blocks")
    if ingress_port in topo.all_ports()[1:]:
        raise TopologyError(f"ingress port {ingress_port} collides with a port derived from port_base {base}")
    return topo


def with_state_workers(topo: Topology, workers: list[Mapping[str, object]]) -> Topology:
    """topo with the workers a running mesh's state lists ({"index", "options"} each)."""
    return with_workers(topo, [topo.worker(int(w["index"]), w["options"]) for w in workers])


def with_workers(topo: Topology, workers: list[Instance]) -> Topology:
    """topo with exactly these worker instances (what a running mesh's are)."""
    instances = [i for i in topo.instances if i.service != "worker"] + list(workers)
    # In SERVICES' order (how they start and `gaas status` lists them), whatever their ports.
    return replace(topo, instances=tuple(sorted(instances, key=lambda i: (SERVICES.index(i.service), i.index))))


def load(path: Path, env: Mapping[str, str] | None = None, **overrides) -> Topology:
    """Read the topology file, applying GAAS_HOST / GAAS_PORT_BASE / GAAS_INGRESS_PORT /
    GAAS_INGRESS_PATH / GAAS_WORKERS from env, then explicit keyword overrides (those that are not None)."""
    env = os.environ if env is None else env
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise TopologyError(f"cannot read topology file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path} is not valid YAML: {exc}") from exc
    from_env = {
        "host": env.get("GAAS_HOST") or None,
        "port_base": _int(env["GAAS_PORT_BASE"], "GAAS_PORT_BASE", 1024) if env.get("GAAS_PORT_BASE") else None,
        "ingress_port": _int(env["GAAS_INGRESS_PORT"], "GAAS_INGRESS_PORT", 1) if env.get("GAAS_INGRESS_PORT") else None,
        "ingress_path": env.get("GAAS_INGRESS_PATH") or None,
        "workers": (env["GAAS_WORKERS"] if env.get("GAAS_WORKERS") == "auto"
                    else _int(env["GAAS_WORKERS"], "GAAS_WORKERS (a number or auto)", 1)) if env.get("GAAS_WORKERS") else None,
    }
    merged = {k: v for k, v in from_env.items() if v is not None}
    merged.update({k: v for k, v in overrides.items() if v is not None})
    return build(doc or {}, **merged)


def with_worker_options(topo: Topology, **options: object) -> Topology:
    """A copy whose workers, present and to come, carry extra engine settings (`gaas up
    --kv-cache-blocks`; tests shrink the cache)."""
    instances = tuple(
        replace(i, options={**i.options, **options}) if i.service == "worker" else i for i in topo.instances
    )
    return replace(topo, instances=instances, worker_defaults={**topo.worker_defaults, **options})
