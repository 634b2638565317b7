"""Prometheus metrics: one registry per service, served with the process's default collectors
(process_*, python_gc_*, and vLLM's own in the worker) on the instance's /metrics port."""

from __future__ import annotations

import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# For a request's latency and its parts: from a tenth of a millisecond (a router's own work) to
# minutes (a long generation).
DECOMPOSITION_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                         60, 120, 300)
# For steps measured in microseconds (a scheduling plugin, a directory lookup).
FAST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)


def nearest_rank(values, q: float) -> float:
    """The q-quantile (0 < q <= 1) of values by the nearest-rank method (a value that occurred);
    0.0 for none."""
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)] if s else 0.0


class ServiceMetrics:
    """The metrics every service has, named gaas_<service>_<what>_<unit>, in the service's registry."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry or CollectorRegistry()
        self.rpcs = Counter(
            f"gaas_{service}_grpc_requests_total",
            "gRPC calls handled, by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            f"gaas_{service}_grpc_duration_seconds",
            "Time from the call's arrival to its last message",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def counter(self, what: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(f"gaas_{self.service}_{what}", doc, list(labels), registry=self.registry)

    def gauge(self, what: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(f"gaas_{self.service}_{what}", doc, list(labels), registry=self.registry)

    def histogram(self, what: str, doc: str, labels: tuple[str, ...] = (), buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(f"gaas_{self.service}_{what}", doc, list(labels), buckets=buckets, registry=self.registry)


class MetricsServer:
    """/metrics over HTTP in a daemon thread; stop() closes the socket."""

    def __init__(self, registries: list[CollectorRegistry], host: str, port: int) -> None:
        regs = [*registries, REGISTRY]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                body = b"".join(generate_latest(r) for r in regs)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", self._httpd.server_address[0], self.port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
