"""Tracing (`gaas up --trace`): every connection manager starts a span per request and passes W3C
traceparent on, so the services' spans (gaas.runtime.telemetry) and the Envoys' make one trace."""

from __future__ import annotations

from gaas.ops.traces import TraceTarget, envoy_service

# The cluster spans are exported to (bootstrap adds it when tracing).
OTLP_CLUSTER = "otlp_collector"


def tracing(target: TraceTarget | None, envoy: str, *, edge: bool = False) -> dict:
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
