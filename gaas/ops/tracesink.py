"""The local trace collector of `gaas up --trace`: an OTLP/gRPC receiver (the standard
opentelemetry.proto.collector.trace.v1.TraceService) that appends every export to a file, one
OTLP/JSON line each (ids in hex, as the OTLP/JSON encoding has them). `gaas trace` reads it.

    python -m gaas.ops.tracesink --listen 127.0.0.1:4317 --out .gaas/traces.jsonl
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gaas.runtime.logs import setup_logging

log = logging.getLogger("gaas.ops.tracesink")

# The file is rotated (to <file>.1, replacing the one before) when it grows past this.
MAX_FILE_BYTES = 64 << 20
_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def to_json(request: trace_service_pb2.ExportTraceServiceRequest) -> dict:
    """OTLP/JSON: camelCase fields, enums as numbers, trace and span ids as hex strings."""
    doc = MessageToDict(request, use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in _ID_KEYS:
                    if span.get(key):
                        span[key] = base64.b64decode(span[key]).hex()
                for link in span.get("links", []):
                    for key in _ID_KEYS:
                        if link.get(key):
                            link[key] = base64.b64decode(link[key]).hex()
    return doc


class FileSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, path: Path, max_bytes: int = MAX_FILE_BYTES) -> None:
        self._path = path
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self.spans = 0

    def Export(self, request, context):
        line = json.dumps(to_json(request), separators=(",", ":")) + "\n"
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            if self._file.tell() + len(line) > self._max_bytes:
                self._file.close()
                os.replace(self._path, self._path.with_name(self._path.name + ".1"))
                self._file = open(self._path, "a", encoding="utf-8")
                log.info("rotated %s (kept the previous one as %s.1)", self._path, self._path.name)
            self._file.write(line)
            self._file.flush()
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def serve(listen: str, out: Path) -> None:
    sink = FileSink(out)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.max_receive_message_length", 32 << 20)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    if not server.add_insecure_port(listen):
        raise SystemExit(f"tracesink: cannot listen on {listen}")
    server.start()
    log.info("receiving OTLP/gRPC spans on %s, writing %s", listen, out)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
    sink.close()
    log.info("stopped after %d spans", sink.spans)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaas.ops.tracesink", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", required=True, help="host:port to receive OTLP/gRPC on")
    p.add_argument("--out", required=True, type=Path, help="file to append OTLP/JSON lines to")
    args = p.parse_args(argv)
    setup_logging("tracesink", "tracesink-0")
    serve(args.listen, args.out)


if __name__ == "__main__":
    main()
