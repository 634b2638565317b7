"""Control plane settings, read once at start-up from GAAS_* variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.settings.env import base_settings, env_int, env_str


@dataclass(frozen=True, slots=True)
class ControlConfig:
    # Replica name.
    instance: str
    host: str
    # gRPC port (its sidecar's inbound listener forwards here).
    port: int
    # unix:/path: listen on that Unix socket instead of host:port (only the sidecar can reach it).
    listen: str
    # /metrics port, or -1 for none.
    metrics_port: int
    redis_url: str
    # SQL database of the registries: sqlite:///path or postgresql://...
    database_url: str
    # Deployment file applied at start-up ("" applies nothing).
    deploy_file: str
    # How long a worker's registration lasts without renewal.
    lease_ttl_seconds: int
    grace_seconds: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "ControlConfig":
        return cls(
            **base_settings(env, "control-0", 50051),
            redis_url=env_str(env, "GAAS_REDIS_URL", "redis://127.0.0.1:6379/0"),
            database_url=env_str(env, "GAAS_DATABASE_URL", "sqlite:///.gaas/control.db"),
            deploy_file=env_str(env, "GAAS_DEPLOY_FILE", ""),
            lease_ttl_seconds=env_int(env, "GAAS_LEASE_TTL", 10),
        )
