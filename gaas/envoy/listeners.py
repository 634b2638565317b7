"""Listeners and their HTTP connection managers: addresses (TCP or a Unix socket), the JSON access
log every connection manager writes, and the router filter that ends every filter chain."""

from __future__ import annotations

from pathlib import Path

from gaas.settings import router as router_settings

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


def socket_address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def pipe_address(path: Path) -> dict:
    # Only the owner may connect (the directory is 0700 too).
    return {"pipe": {"path": str(path), "mode": 0o600}}


def file_access_log(path: Path) -> list[dict]:
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


def router_filter() -> dict:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }


def hcm(stat_prefix: str, routes: list[dict], http_filters: list[dict], access_log: Path, **extra) -> dict:
    """An HTTP connection manager with one virtual host (extra's "vhost" adds to it; the rest of
    extra to the manager): http_filters, then the router filter."""
    vhost = {"name": stat_prefix, "domains": ["*"], "routes": routes, **extra.pop("vhost", {})}
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix,
            "codec_type": "AUTO",
            # Streams may sit between tokens, or before a non-streamed answer; only a silence
            # longer than a generation may run ends them (the router ends its own first).
            "stream_idle_timeout": f"{router_settings.stream_idle_timeout_s()}s",
            "access_log": file_access_log(access_log),
            "http_filters": [*http_filters, router_filter()],
            "route_config": {"name": stat_prefix, "virtual_hosts": [vhost]},
            **extra,
        },
    }


def listener(name: str, host: str, port: int, hcm: dict, tls: dict | None = None, pipe: Path | None = None) -> dict:
    """A listener on host:port (or the Unix socket pipe) with one filter chain: hcm, behind tls
    when given."""
    chain: dict = {"filters": [hcm]}
    if tls is not None:
        chain["transport_socket"] = tls
    where = pipe_address(pipe) if pipe else socket_address(host, port)
    return {"name": name, "address": where, "filter_chains": [chain]}
