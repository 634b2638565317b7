"""An Envoy's whole config around its listeners and clusters: its node, its admin interface, the
statistics listener Prometheus scrapes, the cluster spans go to, the ingress's overload manager and
the runtime every Envoy of the mesh shares.

Every Envoy answers Prometheus on a TCP port of its own (its admin's /stats/prometheus, and nothing
else of the admin, which stays on a Unix socket under `gaas up`)."""

from __future__ import annotations

from gaas.contracts import edge
from gaas.envoy.clusters import ads, static_cluster
from gaas.envoy.listeners import listener, router_filter
from gaas.envoy.tracing import OTLP_CLUSTER
from gaas.ops.topology import READY_PATH
from gaas.ops.traces import TraceTarget

STATS_PATH = "/stats/prometheus"


def ready_filter(cluster: str) -> dict:
    """Answers READY_PATH itself: 200 while every host of cluster (a sidecar's own service) passes
    its health check, 503 otherwise."""
    return {"name": "envoy.filters.http.health_check", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.health_check.v3.HealthCheck",
        "pass_through_mode": False,
        "headers": [{"name": ":path", "string_match": {"exact": READY_PATH}}],
        "cluster_min_healthy_percentages": {cluster: {"value": 100.0}},
    }}


def stats_listener(host: str, port: int, admin: dict, ready: str | None = None) -> tuple[dict, dict]:
    """A listener for Prometheus in front of this Envoy's admin (given as its address): GET
    /stats/prometheus (or /metrics) is passed on; nothing else of the admin is reachable. ready:
    the cluster whose health READY_PATH answers (ready_filter)."""
    routes = [
        {"match": {"path": STATS_PATH}, "route": {"cluster": "envoy_admin"}},
        {"match": {"path": "/metrics"}, "route": {"cluster": "envoy_admin", "prefix_rewrite": STATS_PATH}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {
            "inline_string": f"only {STATS_PATH} (or /metrics) is served here\n"}}},
    ]
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "envoy_stats",
            "codec_type": "AUTO",
            "http_filters": [*([ready_filter(ready)] if ready else []), router_filter()],
            "route_config": {"name": "envoy_stats", "virtual_hosts": [
                {"name": "envoy_stats", "domains": ["*"], "routes": routes}]},
        },
    }
    cluster = {
        "name": "envoy_admin",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "envoy_admin", "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": admin}}]}]},
    }
    return listener("stats", host, port, hcm), cluster


def edge_overload() -> dict:
    """The ingress's overload manager: its connections bounded (past edge.MAX_CONNECTIONS new
    ones wait in the kernel's backlog), and its own memory watched: past 95% of
    edge.ENVOY_HEAP_BYTES it frees what it can, past 98% it refuses new requests (503) rather than
    grow until the kernel kills it with every stream it holds."""
    heap = "envoy.resource_monitors.fixed_heap"
    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {"name": heap, "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                "max_heap_size_bytes": edge.ENVOY_HEAP_BYTES}},
            {"name": "envoy.resource_monitors.global_downstream_max_connections", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3."
                         "DownstreamConnectionsConfig",
                "max_active_downstream_connections": edge.MAX_CONNECTIONS}},
        ],
        "actions": [
            {"name": "envoy.overload_actions.shrink_heap", "triggers": [{"name": heap, "threshold": {"value": 0.95}}]},
            {"name": "envoy.overload_actions.stop_accepting_requests",
             "triggers": [{"name": heap, "threshold": {"value": 0.98}}]},
        ],
    }


def bootstrap(name: str, admin: dict, listeners: list[dict], clusters: list[dict], *,
              stats: tuple[str, int] | None = None, trace: TraceTarget | None = None, edge_proxy: bool = False,
              xds: dict | None = None, ready: str | None = None) -> dict:
    """An Envoy's whole config. edge_proxy: the ingress, whose connections and memory the overload
    manager bounds (edge_overload); a sidecar bounds its connections by runtime. xds: the cluster of
    control's replicas, when this Envoy takes the workers' endpoints from them (clusters.ads)."""
    listeners, clusters = list(listeners), list(clusters)
    if xds is not None:
        clusters.append(xds)
    if stats is not None:
        scrape, admin_cluster = stats_listener(*stats, admin, ready)
        listeners.append(scrape)
        clusters.append(admin_cluster)
    if trace is not None:
        clusters.append(static_cluster(OTLP_CLUSTER, [(trace.host, trace.port)], health_check=False))
    return {
        "node": {"id": name, "cluster": name.rsplit("-", 1)[0]},
        "admin": {"address": admin},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        **({"dynamic_resources": ads()} if xds is not None else {}),
        **({"overload_manager": edge_overload()} if edge_proxy else {}),
        "layered_runtime": {
            "layers": [{"name": "static", "static_layer": {
                **({} if edge_proxy else {"overload": {"global_downstream_max_connections": 50000}}),
                # An ext_proc call (the direct path's decision) that is over is half-closed and left
                # for the router to end, not reset: resetting it right after its last message made
                # the router's sidecar close the whole HTTP/2 connection from the ingress now and
                # then as a protocol error, with every decision call on it.
                "envoy.reloadable_features.ext_proc_graceful_grpc_close": True,
            }}]
        },
    }
