"""OpenTelemetry tracing for gRPC servers and clients; off unless configured.

Set OTEL_EXPORTER_OTLP_ENDPOINT (e.g. http://127.0.0.1:4317) to export spans over OTLP/gRPC:
every service then instruments its server and its client channels. Without it no interceptor is
installed at all: nothing would be exported, and the instrumentation would still cost time on
every streamed message (and log spurious context errors when a client cancels a stream).
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace

log = logging.getLogger(__name__)


def make_tracer_provider(service: str, instance: str) -> trace.TracerProvider:
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if not endpoint:
        return trace.NoOpTracerProvider()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({"service.name": f"gaas-{service}", "service.instance.id": instance})
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("exporting traces to %s", endpoint)
    return provider


def enabled(provider: trace.TracerProvider) -> bool:
    return not isinstance(provider, trace.NoOpTracerProvider)


def plain_tracer(provider: trace.TracerProvider | None, name: str) -> trace.Tracer | None:
    """The tracer a plain (non-gRPC) front of a service starts its server spans with; None when
    tracing is off (its calls then start none)."""
    return provider.get_tracer(name) if provider is not None and enabled(provider) else None


def server_interceptors(provider: trace.TracerProvider) -> list:
    if not enabled(provider):
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=provider)]


def client_interceptors(provider: trace.TracerProvider) -> list:
    if not enabled(provider):
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=provider))


def shutdown(provider: trace.TracerProvider) -> None:
    if hasattr(provider, "shutdown"):
        provider.shutdown()
