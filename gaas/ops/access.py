"""Who may call what in the mesh: the one access table. Each inbound sidecar's RBAC filter
(gaas/envoy/rbac.py) is generated from method_paths(), which reads ALLOWED_CALLERS and the
router's public APIs below; nothing else in the mesh says who may call which method.

Callers are identity kinds (spiffe://gaas.local/<kind>/..., gaas/ops/pki.py): the services'
kinds, "operator" (the `gaas` CLI) and "ingress" (the edge Envoy). A method of a service's own API
not named here is the operator's alone; health checks are open to every identity of the mesh
(the RBAC filter adds that).
"""

from __future__ import annotations

from gaas.contracts.services import (
    AUTHZ_SERVICE, DIRECT_GENERATION, EXT_PROC_PROCESS, GRPC_SERVICE, OPENAI_SERVICE, XDS_SERVICE,
)

# Per kind, who may call each method of its own gRPC service (GRPC_SERVICE).
ALLOWED_CALLERS: dict[str, dict[str, tuple[str, ...]]] = {
    "control": {
        "RegisterWorker": ("worker",), "RenewLease": ("worker",), "DeregisterWorker": ("worker",),
        "ListWorkers": ("router", "kvcache", "operator"),
        "ListModels": ("router", "operator"),
        # The operator's too: `gaas up` checks the demo key it saved at an earlier start.
        "Authenticate": ("router", "operator"),
        # A new worker's too: it primes them before it takes traffic (services/worker/warmup.py).
        "ListPublicPrefixes": ("router", "operator", "worker"),
        "ListTenants": ("billing", "operator"),
        # A worker whose engine cannot start says why (its version's roll-out halts); so does the
        # operator's launcher for a pool it cannot place.
        "ReportPoolFailure": ("worker", "operator"),
    },
    "kvcache": {"Lookup": ("router",), "Provision": ("router",), "Follow": ("router",)},
    "billing": {"GetUsage": ("router", "operator"),
                # The Files and Batch routes, for the caller's tenant; the batch runners.
                **{m: ("router", "operator") for m in (
                    "CreateFile", "GetFile", "ListFiles", "DeleteFile", "ReadFile", "CreateBatch", "GetBatch",
                    "ListBatches", "CancelBatch")},
                **{m: ("router",) for m in (
                    "ClaimBatchItems", "RenewBatchItems", "CompleteBatchItem", "ReleaseBatchItems")}},
    "worker": {"Generate": ("router",), "WatchKVEvents": ("kvcache",)},
    # The router's public APIs (and server reflection) are the ingress's; gaas.v1.Router (flow
    # status) is the operator's.
    "router": {"*": ("ingress",)},
}

# The services a router serves to the ingress, whole (ALLOWED_CALLERS["router"]["*"]).
ROUTER_PUBLIC = (GRPC_SERVICE["router"], OPENAI_SERVICE, "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")
# The router's flow status, the operator's alone.
ROUTER_OPERATOR = "gaas.v1.Router"


def method_paths(kind: str, direct: bool = False) -> dict[str, tuple[str, ...]]:
    """gRPC path (or path prefix, ending in "/") -> the caller kinds allowed, for kind's inbound.
    direct: the ingress sends generations to the workers itself (ingress.path: direct)."""
    if kind == "router":
        paths = {**{f"/{name}/": ALLOWED_CALLERS["router"]["*"] for name in ROUTER_PUBLIC},
                 f"/{ROUTER_OPERATOR}/": ("operator",),
                 # The ingress checks each request's key here, on its headers (services/router/edgeauth.py).
                 f"/{AUTHZ_SERVICE}/Check": ("ingress",)}
        if direct:
            # The ingress asks the router where each generation goes (services/router/extproc.py).
            paths[EXT_PROC_PROCESS] = ("ingress",)
        return paths
    from google.protobuf import descriptor_pool

    from gaas.v1 import billing_pb2, control_pb2, kvcache_pb2, worker_pb2  # noqa: F401 - fill the pool

    service = descriptor_pool.Default().FindServiceByName(GRPC_SERVICE[kind])
    allowed = ALLOWED_CALLERS.get(kind, {})
    paths = {f"/{service.full_name}/{m.name}": allowed.get(m.name, ("operator",)) for m in service.methods}
    if kind == "control":
        # The workers' endpoints, to every Envoy that reaches workers (services/control/xds.py).
        paths[f"/{XDS_SERVICE}/StreamAggregatedResources"] = ("ingress", "router", "kvcache", "worker")
    if kind == "worker" and direct:
        # The generations the ingress sends a worker straight, and the streams other workers
        # carry on here when their engine stops (services/worker/carryon.py).
        paths.update({path: ("ingress",) for path in DIRECT_GENERATION})
        path = f"/{service.full_name}/Generate"
        paths[path] = (*paths[path], "worker")
    return paths
