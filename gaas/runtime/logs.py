"""Structured logs: one JSON object per line with service, instance and the current request id."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from gaas.runtime.context import client_request_id_var, request_id_var, tenant_var


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, instance: str) -> None:
        super().__init__()
        self._service = service
        self._instance = instance

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self._service,
            "instance": self._instance,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if rid := request_id_var.get():
            entry["request_id"] = rid
        if cid := client_request_id_var.get():
            entry["client_request_id"] = cid
        if tenant := tenant_var.get():
            entry["tenant"] = tenant
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(service: str, instance: str, level: str | None = None) -> None:
    """Route the root logger to stderr as JSON lines (GAAS_LOG_FORMAT=text for plain lines)."""
    level = (level or os.environ.get("GAAS_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("GAAS_LOG_FORMAT", "json") == "text":
        handler.setFormatter(logging.Formatter(f"%(asctime)s {instance} %(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(JsonFormatter(service, instance))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("grpc", "asyncio", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
