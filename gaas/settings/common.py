"""The settings every service has (where it listens, its /metrics, its shutdown), declared once
here: each service's settings class lists them first, with its own replica name and port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gaas.settings.env import REQUIRED, setting

# A service's HTTP/1.1 front (a worker's OpenAI answers, a router's decisions for the ingress, both
# on the direct path) listens this many ports above its gRPC port, or on this Unix socket beside its
# gRPC one.
HTTP_PORT_OFFSET = 6
HTTP_SOCKET = "http.sock"


def instance(default: str, also: str = "") -> Any:
    return setting("GAAS_INSTANCE", default, f"replica name{'; ' + also if also else ''}")


def host() -> Any:
    return setting("GAAS_HOST", "127.0.0.1", "the address to listen on")


def port(default: int) -> Any:
    return setting("GAAS_PORT", default, "the gRPC port (the sidecar's inbound listener forwards here)")


def _unix(value: str) -> str | None:
    return None if not value or value.startswith("unix:") else f"must be unix:/path/to/socket, got {value!r}"


def listen() -> Any:
    return setting("GAAS_LISTEN", "", "unix:/path: listen on that Unix socket instead of GAAS_HOST:GAAS_PORT "
                   "(only the sidecar can reach it; gaas up sets it)", check=_unix)


def http_listen_of(listen: str, host: str, port: int) -> str:
    """Where a service serving gRPC at listen (unix:/path, or "" for host:port) serves its HTTP front."""
    if listen.startswith("unix:"):
        return f"unix:{Path(listen.removeprefix('unix:')).with_name(HTTP_SOCKET)}"
    return f"{host}:{int(port) + HTTP_PORT_OFFSET if int(port) else 0}"


def http_listen(what: str) -> Any:
    return setting("GAAS_HTTP_LISTEN", REQUIRED, f"where its HTTP/1.1 front listens (unix:/path or host:port): {what}",
                   derived=lambda s: http_listen_of(s["listen"], s["host"], s["port"]),
                   shown_default=f"{HTTP_SOCKET} beside GAAS_LISTEN's socket, else GAAS_PORT+{HTTP_PORT_OFFSET}")


def metrics_port() -> Any:
    return setting("GAAS_METRICS_PORT", -1, "the /metrics port (-1: none)")


def grace_seconds() -> Any:
    return setting("GAAS_GRACE_SECONDS", 10.0, "seconds running calls get to finish at shutdown")
