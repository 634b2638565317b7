"""KV directory settings, read once at start-up from GAAS_* variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.runtime.envconfig import base_settings


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    instance: str
    host: str
    port: int
    # /metrics port, or -1 for none.
    metrics_port: int
    grace_seconds: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "KVCacheConfig":
        return cls(**base_settings(env, "kvcache-0", 50081))
