"""Probing a running mesh from outside: each instance's health through its sidecar, each Envoy's
readiness, and the workers registered with control. Used by `gaas status` and `gaas up`."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gaas.contracts.services import WORKERS_CLUSTER
from gaas.ops import pki
from gaas.ops.topology import LocalSockets, Topology, sockets_root
from gaas.v1 import control_pb2, control_pb2_grpc


@dataclass(slots=True)
class InstanceHealth:
    name: str
    service: str
    # Where peers reach it (its sidecar's inbound listener).
    address: str
    # SERVING, NOT_SERVING, UNREACHABLE or UNKNOWN.
    health: str
    # Whether its Envoy sidecar answers ready on the admin port.
    sidecar_ready: bool
    detail: str = ""


@dataclass(slots=True)
class MeshHealth:
    ingress: str
    ingress_ready: bool
    instances: list[InstanceHealth]
    # Workers with a live lease, as control lists them (empty when control is unreachable).
    workers: list[dict] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.ingress_ready and all(i.health == "SERVING" and i.sidecar_ready for i in self.instances)

    def to_dict(self) -> dict:
        return {**asdict(self), "healthy": self.healthy}


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP to a Unix socket (Envoy's admin interface listens on one)."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def envoy_admin(admin: Path, path: str, method: str = "GET", timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of one call to an Envoy's admin interface at the Unix socket admin."""
    conn = _UnixHTTPConnection(admin, timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def envoy_ready(admin: Path, timeout: float = 1.0) -> bool:
    try:
        return envoy_admin(admin, "/ready", timeout=timeout)[0] == 200
    except (OSError, http.client.HTTPException):
        return False


# The ingress's clusters a request needs a healthy host of (the routers: its decision or its route,
# and its key check): until its health checks have passed one, a request gets 503 no_healthy_upstream.
INGRESS_NEEDS = ("router", "router_authz")


def ingress_ready(admin: Path, timeout: float = 1.0, workers: Iterable[str] = ()) -> bool:
    """The ingress's Envoy is ready and has a healthy router to send requests to (each cluster of
    INGRESS_NEEDS it has, from its admin /clusters: `NAME::HOST::health_flags::healthy`), and knows
    each of workers (addresses, on the direct path: control's xDS has reached it; a request placed
    on a worker it does not know yet is a 503 no_healthy_upstream)."""
    if not envoy_ready(admin, timeout):
        return False
    lines = _cluster_hosts(admin, timeout)
    if lines is None:
        return False
    for cluster in INGRESS_NEEDS:
        mine = [line for line in lines if line.startswith(cluster + "::")]
        if mine and not any(line.endswith("::health_flags::healthy") for line in mine):
            return False
    return _knows(lines, workers)


def _cluster_hosts(admin: Path, timeout: float) -> list[str] | None:
    """An Envoy's admin /clusters lines of its hosts' health (None: it did not answer)."""
    try:
        status, body = envoy_admin(admin, "/clusters", timeout=timeout)
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    return [line for line in body.decode(errors="replace").splitlines() if "::health_flags::" in line]


def _knows(lines: list[str], workers: Iterable[str]) -> bool:
    known = {line.split("::")[1] for line in lines if line.startswith(WORKERS_CLUSTER + "::")}
    return set(workers) <= known


def knows_workers(admin: Path, workers: Iterable[str], timeout: float = 1.0) -> bool:
    """An Envoy that sends streams to workers (a router's sidecar) knows each of workers (their
    addresses: control's xDS has reached it; a stream to one it does not know yet is a 503
    no_healthy_upstream)."""
    workers = list(workers)
    if not workers:
        return True
    lines = _cluster_hosts(admin, timeout)
    return lines is not None and _knows(lines, workers)


def routers_lagging(topo: Topology, run_dir: Path, workers: Iterable[str], timeout: float = 1.0) -> list[str]:
    """The routers whose sidecars do not know each of workers yet (addresses). `gaas up` waits
    for none before it says the mesh is ready (its first requests would get 503s); later, a
    router that lags a worker just added for a moment is not unhealthy, so status does not ask."""
    sockets = sockets_root(run_dir)
    workers = list(workers)
    return [r.name for r in topo.of("router") if not knows_workers(LocalSockets.of(sockets, r.name).admin, workers,
                                                                    timeout)]


def grpc_health(address: str, timeout: float = 1.0, run_dir: Path | None = None) -> tuple[str, str]:
    """(status, detail) of the standard health service at address (a sidecar, reached as the
    operator of run_dir's mesh; default $GAAS_HOME)."""
    with pki.operator_channel(address, run_dir) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "UNREACHABLE", exc.details() or code.name
            return "UNKNOWN", f"{code.name}: {exc.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status), ""


def list_workers(control_address: str, timeout: float = 1.0, run_dir: Path | None = None) -> list[dict]:
    with pki.operator_channel(control_address, run_dir) as channel:
        try:
            resp = control_pb2_grpc.ControlStub(channel).ListWorkers(control_pb2.ListWorkersRequest(), timeout=timeout)
        except grpc.RpcError:
            return []
    return [
        {
            "worker_id": w.worker_id,
            "address": w.address,
            "model": w.model,
            "model_version": w.model_version,
            "backend": w.backend,
            "device": w.device,
            "engine_version": w.engine_version,
            "block_size": w.block_size,
            "max_model_len": w.max_model_len,
            "state": control_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_"),
            "load": {
                "running": w.load.running_requests,
                "waiting": w.load.waiting_requests,
                "kv_cache_usage": round(w.load.kv_cache_usage, 4),
                "kv_cache_blocks": w.load.kv_cache_blocks,
                "device_memory_used": w.load.device_memory_used,
                "device_memory_total": w.load.device_memory_total,
                "device_utilization": round(w.load.device_utilization, 3),
                "reported_unix_ms": w.load.reported_unix_ms,
                "adapters": list(w.load.adapters),
                "adapter_slots": w.load.adapter_slots,
                "preemptions": w.load.preemptions,
                # What the worker's device reports of itself (NVML's name and NVLink peers on a GPU).
                "device_kind": w.load.device.kind,
                "device_name": w.load.device.name,
                "nvlink_peers": list(w.load.device.nvlink_peers),
            },
        }
        for w in resp.workers
    ]


def kv_stats(kvcache_address: str, timeout: float = 1.0, run_dir: Path | None = None) -> dict | None:
    """The KV directory's figures (gaas.v1.DirectoryStats as JSON), None when it does not answer."""
    from google.protobuf import json_format

    from gaas.v1 import kvcache_pb2, kvcache_pb2_grpc

    with pki.operator_channel(kvcache_address, run_dir) as channel:
        try:
            stats = kvcache_pb2_grpc.KVCacheStub(channel).GetStats(kvcache_pb2.GetStatsRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
    return json_format.MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def probe(topo: Topology, run_dir: Path, timeout: float = 1.0) -> MeshHealth:
    """Everything at once (in parallel, so a dead mesh answers within about one timeout), as the
    operator of the mesh run from run_dir (its certificate; its Envoys' admin sockets)."""
    sockets = sockets_root(run_dir)

    def one(inst) -> InstanceHealth:
        status, detail = grpc_health(inst.inbound, timeout, run_dir)
        return InstanceHealth(
            name=inst.name,
            service=inst.service,
            address=inst.inbound,
            health=status,
            sidecar_ready=envoy_ready(LocalSockets.of(sockets, inst.name).admin, timeout),
            detail=detail,
        )

    def ingress(workers_f) -> bool:
        serving = [w["address"] for w in (workers_f.result() if workers_f else []) if w.get("state") == "SERVING"]
        return all(ingress_ready(LocalSockets.of(sockets, name).admin, timeout,
                                 serving if topo.ingress_path == "direct" else ()) for name in topo.ingresses)

    with ThreadPoolExecutor(max_workers=8) as pool:
        controls = topo.of("control")
        workers_f = pool.submit(list_workers, controls[0].inbound, timeout, run_dir) if controls else None
        ingress_f = pool.submit(ingress, workers_f)
        kvs = topo.of("kvcache")
        kv_f = pool.submit(kv_stats, kvs[0].inbound, timeout, run_dir) if kvs else None
        instances = list(pool.map(one, topo.instances))
        workers = workers_f.result() if workers_f else []
        cached = {w["worker_id"]: w for w in ((kv_f.result() if kv_f else None) or {}).get("per_worker", [])}
        for w in workers:
            w["cached_blocks"] = int(cached.get(w["worker_id"], {}).get("blocks", 0))
        return MeshHealth(ingress=topo.ingress, ingress_ready=ingress_f.result(), instances=instances, workers=workers)
