"""A service instance's sidecar: an inbound listener in front of the service (mutual TLS, RBAC from
the access table, the verified caller passed on) and, when the service calls anyone, an outbound
listener that routes by gRPC service name to the peers' inbound listeners. Each cluster of peers is
health-checked with the standard gRPC health protocol, and checks that the peer's certificate is of
the kind it dials.

  router -> router's sidecar outbound -> (x-gaas-worker: one of the mesh's workers) -> worker's
  sidecar inbound -> worker
"""

from __future__ import annotations

from pathlib import Path

from gaas.envoy.bootstrap import bootstrap
from gaas.envoy.clusters import WORKERS_CLUSTER, pipe_cluster, static_cluster, workers_cluster, xds_cluster
from gaas.envoy.listeners import hcm, listener, pipe_address, socket_address
from gaas.envoy.rbac import rbac
from gaas.envoy.routes import RETRY_UNREACHED, decorator, grpc_route, unreached_replies
from gaas.envoy.tls import client_tls, server_tls
from gaas.envoy.tracing import tracing
from gaas.ops import pki
from gaas.contracts.services import EXT_PROC_PROCESS, GRPC_SERVICE, OPENAI_DIRECT_PATHS
from gaas.ops.topology import TALKS_TO, Instance, LocalSockets, Topology
from gaas.ops.traces import TraceTarget
from gaas.runtime.context import PEER_ADDRESS_HEADER, WORKER_HEADER


# A service's HTTP/1.1 front on the direct path, where its sidecar sends what it serves there: a
# worker's OpenAI generations the ingress streams from it (services/worker/http.py), a router's
# decision calls (services/router/extproc_http.py).
LOCAL_HTTP = "local_http"


def http_paths(kind: str, direct: bool) -> tuple[str, ...]:
    """The paths kind's sidecar sends to its HTTP front (LOCAL_HTTP)."""
    if not direct:
        return ()
    return {"worker": OPENAI_DIRECT_PATHS, "router": (EXT_PROC_PROCESS,)}.get(kind, ())


def inbound_hcm(stat_prefix: str, kind: str, access_log: Path, trace: TraceTarget | None = None,
                envoy: str = "", instance: str = "", direct: bool = False) -> dict:
    """A sidecar's inbound HTTP connection manager, to its one service (the local_service cluster;
    what it serves over HTTP/1.1 on the direct path to its HTTP front, LOCAL_HTTP: http_paths):
    RBAC for kind's methods, the verified caller passed on, its own replies for a service it could
    not reach marked."""
    to_http = http_paths(kind, direct)
    return hcm(
        stat_prefix,
        [*({"match": {"path": path}, "route": {"cluster": LOCAL_HTTP, "timeout": "0s"},
            **decorator(f"inbound to {instance or kind}")} for path in to_http),
         {"match": {"prefix": "/"}, "route": {"cluster": "local_service", "timeout": "0s"},
          **decorator(f"inbound to {instance or kind}")}],
        [rbac(kind, direct)],
        access_log,
        # The service learns who called from what this sidecar verified, never from the caller.
        forward_client_cert_details="SANITIZE_SET",
        set_current_client_cert_details={"uri": True},
        local_reply_config=unreached_replies(),
        # And from which address it called (a worker whose certificate is its pool's registers
        # only its own address: services/control/servicer.py).
        vhost={"request_headers_to_add": [{
            "header": {"key": PEER_ADDRESS_HEADER, "value": "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]},
        **tracing(trace, envoy),
    )


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
    listeners = [listener("inbound", topo.bind(inst), inst.inbound_port, inbound, server_tls(creds))]
    clusters = [pipe_cluster("local_service", local.service, health_check=topo.pod) if local
                else static_cluster("local_service", [(inst.host, inst.port)], health_check=False)]
    if http_paths(inst.service, topo.ingress_path == "direct"):
        clusters.append(pipe_cluster(LOCAL_HTTP, local.http, http1=True) if local
                        else static_cluster(LOCAL_HTTP, [(inst.host, inst.http_port)], health_check=False, http1=True))

    peers = TALKS_TO[inst.service]
    if inst.service == "worker" and topo.ingress_path == "direct":
        # A worker the ingress streams from carries a stream its engine cannot finish on at
        # another worker (services/worker/carryon.py).
        peers = (*peers, "worker")
    if peers:
        routes = []
        for peer in peers:
            prefix = f"/{GRPC_SERVICE[peer]}/"
            if peer == "worker":
                # The caller picked the worker; the header names its sidecar, one of the workers
                # control says are the mesh's (workers_cluster).
                routes.append({
                    "match": {"prefix": prefix, "grpc": {}, "headers": [{"name": WORKER_HEADER, "present_match": True}]},
                    "route": {"cluster": WORKERS_CLUSTER, "timeout": "0s"},
                    **decorator("outbound to a worker"),
                })
                clusters.append(workers_cluster(creds))
            else:
                routes.append(grpc_route(prefix, peer, retry=RETRY_UNREACHED, operation=f"outbound to {peer}"))
                clusters.append(static_cluster(peer, [(p.host, p.inbound_port) for p in topo.of(peer)],
                                               health_check=True, tls=client_tls(creds, peer)))
        outbound = hcm(f"{inst.name}_outbound", routes, [], log_dir / f"envoy-{inst.name}-access.log",
                       **tracing(trace, envoy))
        listeners.append(listener("outbound", inst.host, inst.outbound_port, outbound,
                                  pipe=local.outbound if local else None))
    admin = pipe_address(local.admin) if local else socket_address(inst.host, inst.admin_port)
    reaches_workers = "worker" in peers
    return bootstrap(envoy, admin, listeners, clusters, stats=(topo.bind(inst), inst.envoy_stats_port), trace=trace,
                     ready="local_service" if topo.pod else None,
                     xds=xds_cluster(topo, creds) if reaches_workers else None)
