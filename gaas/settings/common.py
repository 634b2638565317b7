"""The settings every service has (where it listens, its /metrics, its shutdown), declared once
here: each service's settings class lists them first, with its own replica name and port."""

from __future__ import annotations

from typing import Any

from gaas.settings.env import setting


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


def metrics_port() -> Any:
    return setting("GAAS_METRICS_PORT", -1, "the /metrics port (-1: none)")


def grace_seconds() -> Any:
    return setting("GAAS_GRACE_SECONDS", 10.0, "seconds running calls get to finish at shutdown")
