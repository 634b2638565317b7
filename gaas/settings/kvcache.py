"""The KV directory's settings (services/kvcache), read once at start-up from GAAS_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from gaas.settings import common
from gaas.settings.env import REQUIRED, Settings, setting


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheSettings(Settings):
    instance: str = common.instance("kvcache-0")
    host: str = common.host()
    port: int = common.port(50081)
    listen: str = common.listen()
    metrics_port: int = common.metrics_port()
    grace_seconds: float = common.grace_seconds()
    outbound: str = setting("GAAS_OUTBOUND", REQUIRED,
                            "host:port (or unix:/path) of the sidecar's outbound listener: control (the registry) "
                            "and the workers")
    poll_seconds: float = setting("GAAS_KV_POLL_SECONDS", 1.0,
                                  "how often the registry is read (workers joining and leaving)")
    provision_ttl_seconds: float = setting("GAAS_KV_PROVISION_TTL", 30.0,
                                           "seconds a router's provision counts before the engine confirms it")
