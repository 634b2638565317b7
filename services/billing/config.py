"""Billing settings, read once at start-up from GAAS_* variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.settings.env import base_settings, env_float, env_int, env_str


@dataclass(frozen=True, slots=True)
class BillingConfig:
    instance: str
    host: str
    port: int
    # unix:/path: listen on that Unix socket instead of host:port (only the sidecar can reach it).
    listen: str
    # /metrics port, or -1 for none.
    metrics_port: int
    grace_seconds: float
    # The usage ledger: sqlite:///path or postgresql://...
    database_url: str
    # Redis: the usage stream, budgets.
    redis_url: str
    # host:port of the sidecar's outbound listener (control: the tenants' Stripe customers).
    outbound: str
    # The deployment file: the Stripe meters' event names.
    deploy_file: str
    # Stripe: the secret key ("" turns syncing off) and the API's base address.
    stripe_api_key: str
    stripe_api_base: str
    # Usage is reported per window of this many seconds, once the window closed this long ago.
    stripe_window_seconds: float
    stripe_grace_seconds: float
    # Most meter events sent per second.
    stripe_rate: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "BillingConfig":
        return cls(
            **base_settings(env, "billing-0", 50091),
            database_url=env_str(env, "GAAS_BILLING_DATABASE_URL", "sqlite:///.gaas/billing.db"),
            redis_url=env_str(env, "GAAS_REDIS_URL", "redis://127.0.0.1:6379/0"),
            outbound=env.get("GAAS_OUTBOUND", ""),
            deploy_file=env.get("GAAS_DEPLOY_FILE", ""),
            stripe_api_key=env.get("GAAS_STRIPE_API_KEY", ""),
            stripe_api_base=env_str(env, "GAAS_STRIPE_API_BASE", "https://api.stripe.com"),
            stripe_window_seconds=env_float(env, "GAAS_STRIPE_WINDOW_SECONDS", 3600.0),
            stripe_grace_seconds=env_float(env, "GAAS_STRIPE_GRACE_SECONDS", 120.0),
            stripe_rate=env_int(env, "GAAS_STRIPE_RATE", 100),
        )
