"""Router settings, read once at start-up from GAAS_* variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.runtime.envconfig import base_settings, env_float, env_int, env_str


@dataclass(frozen=True, slots=True)
class RouterConfig:
    instance: str
    host: str
    # gRPC port (the sidecar's inbound listener forwards here).
    port: int
    # /metrics port, or -1 for none.
    metrics_port: int
    # host:port of the sidecar's outbound listener: control, kvcache and workers are reached there.
    outbound: str
    # Worker-picking policy (see services/router/picker.py).
    picker: str
    # Seconds the worker list from control is reused.
    registry_ttl_seconds: float
    # Other workers tried when one fails before its first token.
    retries: int
    # Seconds a worker that failed is skipped.
    eject_seconds: float
    # Longest a generation may stream when the client set no deadline.
    max_stream_seconds: float
    # Seconds an API key lookup is reused (a revoked key stops working within this).
    auth_cache_seconds: float
    # Largest OpenAI-API request body accepted.
    max_body_bytes: int
    grace_seconds: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RouterConfig":
        return cls(
            **base_settings(env, "router-0", 50071),
            outbound=env_str(env, "GAAS_OUTBOUND"),
            picker=env_str(env, "GAAS_ROUTER_PICKER", "round_robin"),
            registry_ttl_seconds=env_float(env, "GAAS_REGISTRY_TTL", 1.0),
            retries=env_int(env, "GAAS_ROUTER_RETRIES", 2),
            eject_seconds=env_float(env, "GAAS_EJECT_SECONDS", 5.0),
            max_stream_seconds=env_float(env, "GAAS_MAX_STREAM_SECONDS", 600.0),
            auth_cache_seconds=env_float(env, "GAAS_AUTH_CACHE_SECONDS", 2.0),
            max_body_bytes=env_int(env, "GAAS_MAX_BODY_BYTES", 1 << 20),
        )
