"""Clusters: a fixed set of endpoints over HTTP/2 (health-checked, with circuit breakers and outlier
detection, for a service's replicas), one gRPC server on a Unix socket (a sidecar's own service),
the workers' sidecars, whose endpoints control serves as they register and leave (xDS), each
request going to the one its caller names in x-gaas-worker, and the cluster of control's replicas
that serve them."""

from __future__ import annotations

from pathlib import Path

from gaas.contracts.headers import WORKER_HEADER
from gaas.contracts.services import WORKERS_CLUSTER
from gaas.envoy.listeners import socket_address
from gaas.envoy.tls import client_tls
from gaas.ops import pki
from gaas.ops.topology import Topology

HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}
# A server of plain HTTP/1.1 (a service's HTTP front): one request at a time per connection; its
# trailers passed on (a router's decision calls end with their gRPC status there).
HTTP1 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http_protocol_options": {"enable_trailers": True}},
    }
}


def static_cluster(name: str, endpoints: list[tuple[str, int]], *, health_check: bool, tls: dict | None = None,
                   streams: int | None = None, eject_on_answers: bool = True, http1: bool = False) -> dict:
    """A cluster of fixed endpoints (HTTP/2; HTTP/1.1 with http1). streams: the most requests in flight to it at once,
    and waiting for a connection (Envoy's circuit breakers; its default is 1,024 each).
    eject_on_answers: a replica answering errors (5xx) in a row is ejected for a while; never for
    a cluster of one (it was the only place to go: ejecting it turned one error into an outage of
    "no healthy upstream"), nor for the routers at the ingress, whose 503s are load shed on
    purpose (ejecting a router that sheds moves its load onto the others)."""
    is_ip = all(h.replace(".", "").isdigit() or ":" in h for h, _ in endpoints)
    cluster = {
        "name": name,
        "type": "STATIC" if is_ip else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": HTTP1 if http1 else HTTP2,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(h, p)}} for h, p in endpoints]}],
        },
    }
    if tls is not None:
        cluster["transport_socket"] = tls
    if health_check:
        cluster["health_checks"] = [
            {
                "timeout": "1s",
                "interval": "2s",
                # Keep checking idle clusters often, so a dead peer is noticed before traffic needs it.
                "no_traffic_interval": "2s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {},
            }
        ]
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
        # When a replica dies, every stream it held may be retried at once (Envoy's default allows
        # 3 retries in flight per cluster and fails the rest): up to half the active requests,
        # and at least 32, may be retries.
        cluster["circuit_breakers"] = {"thresholds": [{
            "priority": "DEFAULT",
            "retry_budget": {"budget_percent": {"value": 50.0}, "min_retry_concurrency": 32},
            **({"max_requests": streams, "max_pending_requests": streams} if streams else {}),
        }]}
        # Passive checks too (behind the routers' own circuit breakers): a replica answering 5xx
        # (gRPC UNAVAILABLE / INTERNAL map there) or unreachable several times in a row is ejected
        # for a while, at most half of a cluster at once.
        # (A DNS name stands for every replica behind it: a Kubernetes Service's pods.)
        several = len(endpoints) > 1 or not is_ip
        answers = eject_on_answers and several
        cluster["outlier_detection"] = {
            "consecutive_5xx": 5,
            "enforcing_consecutive_5xx": 100 if answers else 0,
            "consecutive_gateway_failure": 3,
            "enforcing_consecutive_gateway_failure": 100 if answers else 0,
            "interval": "2s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 50,
        }
        if several:
            # A replica that cannot be reached at all (connect failure, reset) is ejected at its
            # first such failure, without waiting for the health checks' interval (with one
            # replica there is nowhere else to go: it stays, and its health checks decide).
            cluster["outlier_detection"].update({
                "split_external_local_origin_errors": True,
                "consecutive_local_origin_failure": 1,
                "enforcing_consecutive_local_origin_failure": 100,
            })
    return cluster


def pipe_cluster(name: str, path: Path, health_check: bool = False, http1: bool = False) -> dict:
    """A cluster of one gRPC server on a Unix socket (http1: a plain HTTP/1.1 one); health_check:
    asked its gRPC health every few seconds (a sidecar in a pod, whose readiness is its service's:
    bootstrap's ready)."""
    checks = {"health_checks": [{"timeout": "1s", "interval": "2s", "no_traffic_interval": "2s",
                                 "unhealthy_threshold": 1, "healthy_threshold": 1, "grpc_health_check": {}}],
              "common_lb_config": {"healthy_panic_threshold": {"value": 0}}} if health_check else {}
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": HTTP1 if http1 else HTTP2,
        "load_assignment": {"cluster_name": name, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": str(path)}}}}]}]},
        **checks,
    }


# The cluster of control's replicas that say who the workers are (WORKERS_CLUSTER).
XDS_CLUSTER = "xds"
# How long an Envoy that starts waits for control's first answer before it goes on with no workers
# (they come when control answers).
XDS_FIRST_ANSWER = "5s"


# Streams to the workers at once, at most, as an Envoy's circuit breaker counts them (the routers'
# admission is the real bound).
WORKER_STREAMS = 1 << 20


def workers_cluster(creds: pki.Credentials) -> dict:
    """Every worker's sidecar (mutual TLS as creds, checking the peer is a worker), their endpoints
    taken from control (xDS: services/control/xds.py) as workers register and leave, so no Envoy
    restarts for a change of the fleet. Envoy's override-host policy sends each request to the
    addresses x-gaas-worker lists, in order (the first, then the next on a retry), the way the
    Gateway API Inference Extension's endpoint picker names its endpoints; only the mesh's
    registered workers are there to be named. Not health-checked: the routers' circuit breakers
    judge workers, and retries before the first token go through the router."""
    return {
        "name": WORKERS_CLUSTER,
        "type": "EDS",
        "connect_timeout": "1s",
        "eds_cluster_config": {"service_name": WORKERS_CLUSTER, "eds_config": {
            "ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": XDS_FIRST_ANSWER}},
        "typed_extension_protocol_options": HTTP2,
        "transport_socket": client_tls(creds, "worker"),
        # Every stream of the mesh may pass here (the ingress on the direct path): no cap of
        # Envoy's own below the routers' admission (its defaults: 1,024 requests at once), and a
        # retry for every request at once, should a worker refuse all it holds untaken (its engine
        # died before their first token: each goes to its second choice; Envoy's default of 3
        # retries in flight per cluster answered the 4th 503 UO, seen with 8 streams).
        "circuit_breakers": {"thresholds": [{
            "priority": "DEFAULT", "max_connections": WORKER_STREAMS, "max_pending_requests": WORKER_STREAMS,
            "max_requests": WORKER_STREAMS,
            "retry_budget": {"budget_percent": {"value": 100.0}, "min_retry_concurrency": 64},
        }]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"header": WORKER_HEADER}],
                # Without a named worker of this mesh (never, from a router): any.
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
                    },
                }}]},
            },
        }}]},
    }


def xds_cluster(topo: Topology, creds: pki.Credentials) -> dict:
    """Control's replicas, as this Envoy asks them for the workers' endpoints (one stream, kept
    open; another replica when this one goes)."""
    return static_cluster(XDS_CLUSTER, [(c.host, c.inbound_port) for c in topo.of("control")],
                          health_check=True, tls=client_tls(creds, "control"))


def ads() -> dict:
    """An Envoy's dynamic_resources: the aggregated discovery stream to control (XDS_CLUSTER)."""
    return {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
                           "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
                           "set_node_on_first_message_only": True}}
