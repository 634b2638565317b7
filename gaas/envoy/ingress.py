"""The ingress, the mesh's one edge Envoy: gRPC and HTTP/1.1 on one port, JSON transcoded to the
router's gRPC APIs (the native one and the OpenAI-compatible one), each request's API key checked by
a router before its body is read, and everything a client could abuse bounded. It reaches the
routers (and, on the direct path, the workers) as the mesh's ingress identity.

  client -> ingress -> router's sidecar inbound -> router
  (direct path) client -> ingress -(the router's decision)-> worker's sidecar inbound -> worker
"""

from __future__ import annotations

from pathlib import Path

from gaas.contracts import batches as batch_terms, edge
from gaas.settings import router as router_settings
from gaas.envoy.bootstrap import bootstrap
from gaas.envoy.clusters import static_cluster, workers_cluster, xds_cluster
from gaas.envoy.direct import DIRECT_RETRY_BUFFER, EXT_PROC_FILTER, OPENAI_DECISION_FILTER, TRANSCODER, \
    direct_routes, ext_proc, ext_proc_disabled, openai_http_routes
from gaas.envoy.errors import openai_errors_filter, router_unanswered_replies
from gaas.envoy.listeners import hcm, listener, pipe_address, socket_address
from gaas.envoy.routes import RETRY_BEFORE_RESPONSE, ROUTER_CALL_RETRY, UNREACHED_HEADER, grpc_route
from gaas.envoy.tls import client_tls, downstream_tls
from gaas.envoy.tracing import tracing
from gaas.ops import pki
from gaas.contracts.services import DIRECT_GENERATION, GRPC_SERVICE, OPENAI_DIRECT_HTTP, OPENAI_SERVICE
from gaas.ops.topology import LocalSockets, Topology
from gaas.ops.traces import TraceTarget
from gaas.runtime.context import INGRESS_START_HEADER, REQUEST_ID_HEADER, TENANT_HEADER, WORKER_HEADER

# Services a generic gRPC client may reach at the ingress besides the router's two APIs: health
# and server reflection (grpcurl's list/describe), both answered by the router, which serves
# nothing internal.
PUBLIC_GRPC_EXTRAS = edge.OPEN_GRPC_SERVICES

# The routers as the ingress's key checks reach them: a cluster of their own, whose circuit
# breakers are the checks' budget, apart from the streams of authenticated requests.
AUTHZ_CLUSTER = "router_authz"


# When the request arrived at the ingress, Unix seconds (Envoy's formatter).
INGRESS_START_VALUE = "%START_TIME(%s.%6f)%"


# The client's address as the connection manager decided it (the connection's peer, the proxy
# protocol's source, or X-Forwarded-For's trusted hop: edge_hcm_options), without its port.
CLIENT_ADDRESS_VALUE = "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"


def internal_headers_dropped_early() -> list[dict]:
    """The connection manager's early header mutation: only the router may say who the tenant is,
    which worker serves, or what GaaS's own request id is; never a client. What a client sent of
    them is dropped before anything else, the route's choice included: the connection manager
    chooses the route as the headers arrive, and a filter dropping them after would leave a route
    chosen by a client's own x-gaas-worker (the route to the workers, on which the router is not
    asked). So what the router says at the ingress, on the direct path, is all a worker hears."""
    return [{
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": h} for h in (TENANT_HEADER, WORKER_HEADER, REQUEST_ID_HEADER)],
        },
    }]


def ingress_stamps() -> dict:
    """The ingress's first filter: it stamps the request's arrival and the client's address (what
    the key check's limiter keys on: Envoy's external authorization reports the connection's peer,
    which behind a load balancer is the balancer) over whatever a client sent as them. (What a
    client sent of the headers only the router may set is gone already:
    internal_headers_dropped_early.)"""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [
                # The request's arrival, stamped before any filter reads it (a client's own value
                # overwritten): the router's decision on the direct path reads it here.
                {"append": {"header": {"key": INGRESS_START_HEADER, "value": INGRESS_START_VALUE},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}},
                {"append": {"header": {"key": edge.CLIENT_ADDRESS_HEADER, "value": CLIENT_ADDRESS_VALUE},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}},
            ]},
        },
    }


def ext_authz() -> dict:
    """The ingress checks each request's API key with a router on its headers alone, before it
    reads the body (services/router/edgeauth.py); only the headers that check needs are sent. No
    router answering is a 503 that clients retry (never a request let through unchecked)."""
    return {
        "name": "envoy.filters.http.ext_authz",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
            "grpc_service": {"envoy_grpc": {"cluster_name": AUTHZ_CLUSTER}, "timeout": f"{edge.AUTHZ_TIMEOUT_S}s",
                             "retry_policy": ROUTER_CALL_RETRY},
            "transport_api_version": "V3",
            "failure_mode_allow": False,
            "status_on_error": {"code": "ServiceUnavailable"},
            "allowed_headers": {"patterns": [{"exact": "authorization"}, {"exact": "content-type"},
                                             {"exact": edge.CLIENT_ADDRESS_HEADER}]},
            "include_peer_certificate": False,
        },
    }


def ext_authz_disabled() -> dict:
    """A route's typed_per_filter_config that keeps the key check (ext_authz) off it: a route whose
    decision call (ext_proc; services/router/extproc.py) checks the key on the request's headers,
    so that a generation costs one call to a router, not two."""
    return {"envoy.filters.http.ext_authz": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute", "disabled": True}}


def max_http_body() -> int:
    """The largest HTTP body the ingress buffers for transcoding: the router's limit, and room for
    the framing (a larger body is refused at the ingress with 413, unread)."""
    return router_settings.max_body_bytes() + edge.FRAMING_BYTES


def max_upload_body() -> int:
    """The largest body of an upload (POST /v1/files): a batch input file and its multipart framing."""
    return batch_terms.MAX_UPLOAD_BYTES + edge.FRAMING_BYTES


def upload_route(descriptor_set: Path) -> dict:
    """POST /v1/files, the one route whose body may pass the router's body limit: the transcoder
    buffers up to max_upload_body() here (its per-route config is read on the HTTP request; once
    transcoded, the request is routed as any gRPC one)."""
    return {"match": {"path": "/v1/files", "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]},
            "route": {"cluster": "router", "timeout": "0s", "retry_policy": RETRY_BEFORE_RESPONSE},
            "typed_per_filter_config": {TRANSCODER: transcoder(descriptor_set, max_upload_body())["typed_config"]}}


def transcoder(descriptor_set: Path, max_body: int | None = None) -> dict:
    """The gRPC-JSON transcoder for the router's two APIs (HttpBody methods pass their body through
    raw), with the service descriptors of descriptor_set; max_body: the largest request body it
    buffers (default max_http_body())."""
    return {
        "name": TRANSCODER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
            "proto_descriptor": str(descriptor_set),
            "services": [GRPC_SERVICE["router"], OPENAI_SERVICE],
            "convert_grpc_status": True,
            "max_request_body_size": max_body or max_http_body(),
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


def edge_hcm_options(xff_trusted_hops: int = 0) -> dict:
    """What the ingress's connection manager adds for clients it cannot trust (Envoy's advice for
    an edge proxy): the client's address is the connection's (x-forwarded-for and x-envoy-* headers
    from clients are not believed), but for xff_trusted_hops load balancers in front of it that
    each append the address they saw to X-Forwarded-For (then the client is the address that many
    from its right end), timeouts for headers, whole requests and idle connections, bounded HTTP/2
    streams and windows per connection, paths normalized before any check, and header names with
    underscores refused (an upstream could read them as dashes)."""
    return {
        "use_remote_address": True,
        "xff_num_trusted_hops": xff_trusted_hops,
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


def proxy_protocol() -> dict:
    """A listener filter that takes the client's address from the PROXY protocol header a network
    load balancer (AWS's NLB, for one) sends first; a connection without it is refused."""
    return {"name": "envoy.filters.listener.proxy_protocol", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol"}}


def ingress_config(topo: Topology, descriptor_set: Path, log_dir: Path, authority: pki.Authority,
                   tls: tuple[Path, Path] | None = None, sockets: Path | None = None,
                   trace: TraceTarget | None = None, *, xff_trusted_hops: int = 0,
                   proxied: bool = False, replica: int = 0) -> dict:
    """The edge: gRPC and HTTP/1.1 on one port (TLS with the given certificate and key, when given,
    HTTP/2 offered by ALPN); JSON transcoded to the router's gRPC APIs (the native one and the
    OpenAI-compatible one), whose errors get OpenAI's shape. It reaches the routers as the mesh's
    ingress identity. The client's address: the connection's, or the one xff_trusted_hops load
    balancers in front say (edge_hcm_options), or the PROXY protocol's when proxied. replica: which
    of the ingress's Envoys on this host (ingress-N: its admin and statistics are its own, its
    listener shares the port with the others', SO_REUSEPORT)."""
    name = f"ingress-{replica}"
    direct = topo.ingress_path == "direct"
    # The decision's body, which the transcoder reads on the OpenAI routes' HTTP requests: the
    # client's (the router's limit) and what the router adds (direct.DIRECT_RETRY_BUFFER bounds it).
    decided = transcoder(descriptor_set, DIRECT_RETRY_BUFFER)["typed_config"]
    routes = [
        *(direct_routes() if direct else []),
        *(openai_http_routes(decided) if direct else []),
        upload_route(descriptor_set),
        grpc_route(f"/{GRPC_SERVICE['router']}/", "router", retry=RETRY_BEFORE_RESPONSE, operation="ingress"),
        grpc_route(f"/{OPENAI_SERVICE}/", "router", retry=RETRY_BEFORE_RESPONSE, operation="ingress"),
        *(grpc_route(f"/{name}/", "router", retry=RETRY_BEFORE_RESPONSE, operation="ingress")
          for name in PUBLIC_GRPC_EXTRAS),
        # After transcoding the path is the gRPC one; anything else is not ours.
        {"match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {"inline_string": "not found\n"}}},
    ]
    if direct:
        # The router is asked about the generation routes only, and checks their keys as it decides:
        # the OpenAI routes' HTTP requests before the transcoder (OPENAI_DECISION_FILTER), the rest
        # (a native Generate, gRPC or JSON; an OpenAI route's gRPC request) after it. A request sent
        # to its worker is not asked about again.
        n = len(DIRECT_GENERATION)
        to_workers, to_router = routes[:n], routes[n:2 * n]
        asking = routes[2 * n:2 * n + len(OPENAI_DIRECT_HTTP)]
        for route in routes[:2 * n + len(asking)]:
            route.setdefault("typed_per_filter_config", {}).update(ext_authz_disabled())
        for route in to_workers:
            route["typed_per_filter_config"].update(ext_proc_disabled())
        for route in to_router:
            route["typed_per_filter_config"].update(ext_proc_disabled(OPENAI_DECISION_FILTER))
        for route in asking:
            route["typed_per_filter_config"].update(ext_proc_disabled(EXT_PROC_FILTER))
        for route in routes[2 * n + len(asking):]:
            route.setdefault("typed_per_filter_config", {}).update(ext_proc_disabled())
    manager = hcm(
        "ingress",
        routes,
        # On responses filters run in reverse: the transcoder's output reaches the Lua filter.
        # The key check (ext_authz) comes before the transcoder, which reads the whole body. The
        # router's decision (direct) comes before it for the OpenAI routes' HTTP requests (it reads
        # the JSON and replaces it with the worker's request, which the transcoder frames) and
        # after it for the rest (it reads and replaces the gRPC request).
        [ingress_stamps(), openai_errors_filter(), ext_authz(),
         *([ext_proc(OPENAI_DECISION_FILTER)] if direct else []), transcoder(descriptor_set),
         *([ext_proc()] if direct else [])],
        log_dir / "envoy-ingress-access.log",
        vhost={"response_headers_to_remove": [UNREACHED_HEADER],
               # The request's arrival here, where its latency decomposition starts (a client's
               # own value is overwritten).
               "request_headers_to_add": [{
                   "header": {"key": INGRESS_START_HEADER, "value": INGRESS_START_VALUE},
                   "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
               }]},
        # The client's x-request-id is kept (not replaced by Envoy's) and echoed in the response,
        # as vLLM's server echoes it; GaaS keys everything internal on its own id.
        preserve_external_request_id=True,
        early_header_mutation_extensions=internal_headers_dropped_early(),
        always_set_request_id_in_response=True,
        local_reply_config=router_unanswered_replies(),
        **edge_hcm_options(xff_trusted_hops),
        **tracing(trace, "ingress", edge=True),
    )
    edge_tls = downstream_tls(*tls, ["h2", "http/1.1"]) if tls is not None else None
    edge_listener = listener("ingress", topo.bind(), topo.ingress_port, manager, edge_tls)
    edge_listener["per_connection_buffer_limit_bytes"] = edge.CONNECTION_BUFFER_BYTES
    # (Envoy's default on Linux, said here: the ingress's Envoys all bind the one port.)
    edge_listener["enable_reuse_port"] = True
    if proxied:
        edge_listener["listener_filters"] = [proxy_protocol()]
    ingress_creds = authority.credentials(*pki.INGRESS)
    routers = [(r.host, r.inbound_port) for r in topo.of("router")]
    clusters = [
        static_cluster("router", routers, health_check=True, tls=client_tls(ingress_creds, "router"),
                       streams=edge.ROUTER_STREAMS, eject_on_answers=False),
        static_cluster(AUTHZ_CLUSTER, routers, health_check=True, tls=client_tls(ingress_creds, "router"),
                       streams=edge.AUTHZ_CHECKS, eject_on_answers=False),
    ]
    if direct:
        clusters.append(workers_cluster(ingress_creds))
    admin = (pipe_address(LocalSockets.of(sockets, name).admin) if sockets
             else socket_address(topo.host, topo.ingress_admin_port))
    return bootstrap(name, admin, [edge_listener], clusters, stats=(topo.bind(), topo.ingress_stats_port_of(replica)),
                     trace=trace, edge_proxy=True, xds=xds_cluster(topo, ingress_creds) if direct else None)
