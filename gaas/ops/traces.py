"""Traces of the mesh: where spans go (TraceTarget), and reading what `gaas up --trace` collected.

`gaas up --trace` runs gaas.ops.tracesink, which appends every OTLP export it receives to
<run dir>/traces.jsonl, one OTLP/JSON ExportTraceServiceRequest per line (the OpenTelemetry
Collector's file format: any collector's otlpjsonfile receiver reads it back). This module turns
that file into traces: `gaas trace` lists them, draws one as a waterfall in the terminal, or
writes it as a Chrome trace-event file (Perfetto's ui.perfetto.dev or chrome://tracing open it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

TRACES_FILE = "traces.jsonl"
# What names a trace's request: the router's gaas.request_id, and the x-request-id the ingress saw
# (a client's own, or the one it made and returned in the response).
REQUEST_ID_ATTRIBUTE = "gaas.request_id"
INGRESS_REQUEST_ID_ATTRIBUTE = "guid:x-request-id"


def envoy_service(envoy: str) -> str:
    """The service name an Envoy's spans carry (envoy: "ingress", all its replicas alike, or
    "sidecar-<instance>")."""
    return f"envoy-{envoy}"


INGRESS_SERVICE = envoy_service("ingress")


class TraceError(ValueError):
    """A trace endpoint or trace that cannot be used; the message says what to do."""


@dataclass(frozen=True, slots=True)
class TraceTarget:
    """Where the mesh's spans go: an OTLP/gRPC receiver (plaintext), and the share of requests
    the ingress starts a trace for (the services follow their caller's decision)."""

    host: str
    port: int
    sample_percent: float = 100.0

    @property
    def endpoint(self) -> str:
        """For OTEL_EXPORTER_OTLP_ENDPOINT."""
        return f"http://{self.host}:{self.port}"

    @classmethod
    def parse(cls, url: str, sample_percent: float = 100.0) -> "TraceTarget":
        if not 0 <= sample_percent <= 100:
            raise TraceError(f"the trace sampling share is a percentage (0-100), got {sample_percent:g}")
        parsed = urlparse(url if "://" in url else f"http://{url}")
        if parsed.scheme != "http":
            raise TraceError(f"trace endpoint {url!r}: give a plaintext OTLP/gRPC receiver as http://host:port "
                             "(e.g. a local OpenTelemetry Collector or Jaeger on :4317)")
        try:
            port = parsed.port or 4317
        except ValueError:
            raise TraceError(f"trace endpoint {url!r}: the port is not a number") from None
        if not parsed.hostname:
            raise TraceError(f"trace endpoint {url!r} names no host: give http://host:port")
        return cls(parsed.hostname, port, sample_percent)


@dataclass(slots=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, object] = field(default_factory=dict)
    status: int = 0
    children: list["Span"] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass(slots=True)
class Trace:
    trace_id: str
    spans: list[Span]

    @property
    def start_ns(self) -> int:
        return min(s.start_ns for s in self.spans)

    @property
    def duration_ms(self) -> float:
        return (max(s.end_ns for s in self.spans) - self.start_ns) / 1e6

    def roots(self) -> list[Span]:
        """Spans whose parent is not in the trace (normally one: the ingress's), children linked
        and ordered by start."""
        by_id = {s.span_id: s for s in self.spans}
        for s in self.spans:
            s.children.clear()
        roots = []
        for s in sorted(self.spans, key=lambda s: s.start_ns):
            parent = by_id.get(s.parent_id)
            (parent.children if parent is not None and parent is not s else roots).append(s)
        return roots

    def request_ids(self) -> set[str]:
        ids = {str(s.attributes[REQUEST_ID_ATTRIBUTE]) for s in self.spans if s.attributes.get(REQUEST_ID_ATTRIBUTE)}
        return ids | {str(s.attributes[INGRESS_REQUEST_ID_ATTRIBUTE]) for s in self.spans
                      if s.service == INGRESS_SERVICE and s.attributes.get(INGRESS_REQUEST_ID_ATTRIBUTE)}

    def services(self) -> list[str]:
        return sorted({s.service for s in self.spans})


def _value(v: dict) -> object:
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _attributes(items: Iterable[dict]) -> dict[str, object]:
    return {a["key"]: _value(a.get("value", {})) for a in items}


def spans_of(export: dict) -> Iterator[Span]:
    """The spans of one OTLP/JSON ExportTraceServiceRequest."""
    for rs in export.get("resourceSpans", []):
        service = str(_attributes(rs.get("resource", {}).get("attributes", [])).get("service.name", "unknown"))
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                yield Span(
                    trace_id=s.get("traceId", ""), span_id=s.get("spanId", ""), parent_id=s.get("parentSpanId", ""),
                    name=s.get("name", ""), service=service, kind=int(s.get("kind", 0)),
                    start_ns=int(s.get("startTimeUnixNano", 0)), end_ns=int(s.get("endTimeUnixNano", 0)),
                    attributes=_attributes(s.get("attributes", [])), status=int(s.get("status", {}).get("code", 0)),
                )


def load(path: Path) -> dict[str, Trace]:
    """Every trace in a traces file (and its rotated predecessor), by trace id, oldest first. A
    line cut short (the sink was writing it) is skipped."""
    traces: dict[str, Trace] = {}
    for p in (path.with_name(path.name + ".1"), path):
        if not p.is_file():
            continue
        with open(p, encoding="utf-8") as f:
            for line in f:
                try:
                    export = json.loads(line)
                except json.JSONDecodeError:
                    continue
                for span in spans_of(export):
                    traces.setdefault(span.trace_id, Trace(span.trace_id, [])).spans.append(span)
    return dict(sorted(traces.items(), key=lambda kv: kv[1].start_ns))


def find(traces: dict[str, Trace], key: str) -> Trace:
    """The trace with this id (or an unambiguous prefix of it), or whose request id is key."""
    if key in traces:
        return traces[key]
    by_prefix = [t for tid, t in traces.items() if tid.startswith(key.lower())] if len(key) >= 6 else []
    if len(by_prefix) == 1:
        return by_prefix[0]
    by_request = [t for t in traces.values() if key in t.request_ids()]
    if by_request:
        return by_request[-1]
    raise TraceError(f"no trace {key!r} in the collected traces (a trace id, a prefix of one, or a request id; "
                     "`gaas trace --list` shows them)")


# Attributes worth a place on a waterfall's line.
SHOWN_ATTRIBUTES = ("gaas.worker", "gaas.policy", "gaas.tier", "gaas.queue_ms", "gaas.prefix_tokens",
                    "gaas.attempt", "rpc.grpc.status_code", "http.status_code", "upstream_cluster", "response_flags")


def waterfall(trace: Trace, width: int = 32) -> str:
    """The trace as an indented tree, one span a line: start offset, duration, service, name,
    the telling attributes, and a bar placing it in the request's time."""
    t0, total = trace.start_ns, max(trace.duration_ms, 1e-6)
    ids = ", ".join(sorted(trace.request_ids()))
    lines = [f"trace {trace.trace_id}: {len(trace.spans)} spans from {len(trace.services())} processes, "
             f"{trace.duration_ms:.2f} ms" + (f" (request {ids})" if ids else "")]

    def walk(span: Span, depth: int) -> None:
        at = (span.start_ns - t0) / 1e6
        lo = int(at / total * width)
        n = max(1, round(span.duration_ms / total * width))
        bar = " " * lo + "█" * min(n, width - lo)
        attrs = " ".join(f"{k.removeprefix('gaas.')}={span.attributes[k]}" for k in SHOWN_ATTRIBUTES
                         if k in span.attributes and span.attributes[k] not in ("", None, "-"))
        label = f"{'  ' * depth}{span.service}: {span.name}"
        lines.append(f"{at:8.2f} {span.duration_ms:8.2f} ms |{bar:<{width}}| {label}" + (f"  [{attrs}]" if attrs else ""))
        for child in span.children:
            walk(child, depth + 1)

    for root in trace.roots():
        walk(root, 0)
    return "\n".join(lines)


def chrome_events(trace: Trace) -> dict:
    """The trace in Chrome's trace-event format: one row per process, spans as complete events."""
    services = trace.services()
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": i + 1, "tid": 0, "args": {"name": name}}
        for i, name in enumerate(services)
    ]
    for s in trace.spans:
        events.append({
            "ph": "X", "name": s.name, "cat": s.service, "pid": services.index(s.service) + 1, "tid": 0,
            "ts": s.start_ns / 1e3, "dur": max(s.end_ns - s.start_ns, 0) / 1e3,
            "args": {"span_id": s.span_id, "parent_span_id": s.parent_id, **{k: str(v) for k, v in s.attributes.items()}},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"trace_id": trace.trace_id}}
