"""KV directory settings, read once at start-up from GAAS_* variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.settings.env import base_settings, env_float, env_str


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    instance: str
    host: str
    port: int
    # unix:/path: listen on that Unix socket instead of host:port (only the sidecar can reach it).
    listen: str
    # /metrics port, or -1 for none.
    metrics_port: int
    # host:port of the sidecar's outbound listener: control (the registry) and the workers.
    outbound: str
    # How often the registry is read (workers joining and leaving).
    poll_seconds: float
    # How long a router's provision counts before the engine confirms it.
    provision_ttl_seconds: float
    grace_seconds: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "KVCacheConfig":
        return cls(
            **base_settings(env, "kvcache-0", 50081),
            outbound=env_str(env, "GAAS_OUTBOUND"),
            poll_seconds=env_float(env, "GAAS_KV_POLL_SECONDS", 1.0),
            provision_ttl_seconds=env_float(env, "GAAS_KV_PROVISION_TTL", 30.0),
        )
