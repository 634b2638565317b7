"""The gRPC services of the mesh by name: what each kind of instance serves, what its sidecar's
peers route on, and the names the ingress's Envoy filters call the router by."""

from __future__ import annotations

# The gRPC service each kind serves (what its sidecar's peers route on).
GRPC_SERVICE = {
    "control": "gaas.v1.Control",
    "kvcache": "gaas.v1.KVCache",
    "billing": "gaas.v1.Billing",
    "worker": "gaas.v1.Worker",
    "router": "gaas.v1.Inference",
}

# The router's second public API: OpenAI's HTTP API over HttpBody methods.
OPENAI_SERVICE = "gaas.v1.OpenAI"
# Its methods a worker serves too when the ingress sends them there straight (ingress.path:
# direct), decided by the router's call for that (Envoy's external processing): the generations
# and embeddings.
OPENAI_DIRECT = ("Completions", "ChatCompletions", "Embeddings")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EXT_PROC_PROCESS = f"/{EXT_PROC_SERVICE}/Process"
# Their gRPC paths (a worker serves them over its HTTP front, services/worker/http.py).
OPENAI_DIRECT_PATHS = tuple(f"/{OPENAI_SERVICE}/{m}" for m in OPENAI_DIRECT)
# And their HTTP paths (protos/gaas/v1/openai.proto's http rules), which the ingress transcodes.
OPENAI_DIRECT_HTTP = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
# Every method the ingress asks the router about and may send to a worker straight (ingress.path:
# direct): the OpenAI routes above and the native API's Generate, as gRPC paths.
DIRECT_GENERATION = (*OPENAI_DIRECT_PATHS, f"/{GRPC_SERVICE['router']}/Generate")
# The router's key check for the ingress, on each request's headers (Envoy's external authorization).
AUTHZ_SERVICE = "envoy.service.auth.v3.Authorization"
# Envoy's aggregated discovery service, which control serves: every Envoy that reaches workers takes
# their endpoints from it (services/control/xds.py).
XDS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"

# The Redis channel control publishes on when a worker registers, leaves or changes state (its
# registry: services/control/registry.py), which routers follow to read the registry again at once
# (services/router/registry_changes.py).
REGISTRY_CHANGED_CHANNEL = "gaas:workers:changed"


# The Envoy cluster of every worker's sidecar (its endpoints served by control over xDS), in every
# Envoy that reaches workers; `gaas up` waits until the ingress's holds each registered worker.
WORKERS_CLUSTER = "workers"
