"""The control plane's settings (services/control), read once at start-up from GAAS_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from gaas.settings import common
from gaas.settings.env import Settings, setting


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlSettings(Settings):
    instance: str = common.instance("control-0")
    host: str = common.host()
    port: int = common.port(50051)
    listen: str = common.listen()
    metrics_port: int = common.metrics_port()
    grace_seconds: float = common.grace_seconds()
    redis_url: str = setting("GAAS_REDIS_URL", "redis://127.0.0.1:6379/0", "Redis, where the workers' leases live")
    database_url: str = setting("GAAS_DATABASE_URL", "sqlite:///.gaas/control.db",
                                "the SQL database of the registries (models, tenants, API keys, public prefixes): "
                                "sqlite:///path.db or postgresql://...")
    deploy_file: str = setting("GAAS_DEPLOY_FILE", "", "the deployment file applied at start-up (empty: none)")
    lease_ttl_seconds: int = setting("GAAS_LEASE_TTL", 10, "seconds a worker's registration lasts without renewal")
