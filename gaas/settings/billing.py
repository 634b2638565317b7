"""Billing's settings (services/billing), read once at start-up from GAAS_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from gaas.settings import common
from gaas.settings.env import Settings, setting


@dataclass(frozen=True, slots=True, kw_only=True)
class BillingSettings(Settings):
    instance: str = common.instance("billing-0", "also its name in the usage stream's consumer group")
    host: str = common.host()
    port: int = common.port(50091)
    listen: str = common.listen()
    metrics_port: int = common.metrics_port()
    grace_seconds: float = common.grace_seconds()
    database_url: str = setting("GAAS_BILLING_DATABASE_URL", "sqlite:///.gaas/billing.db",
                                "the usage ledger: sqlite:///path.db or postgresql://...")
    redis_url: str = setting("GAAS_REDIS_URL", "redis://127.0.0.1:6379/0", "Redis: the usage stream, the budgets")
    outbound: str = setting("GAAS_OUTBOUND", "", "host:port (or unix:/path) of the sidecar's outbound listener "
                            "(control: the tenants' Stripe customers); empty: no tenant has one")
    deploy_file: str = setting("GAAS_DEPLOY_FILE", "", "the deployment file: the Stripe meters' event names "
                               "(empty: the default names)")
    files_dir: str = setting("GAAS_FILES_DIR", ".gaas/files", "where batch files (uploads, outputs) are kept: a "
                             "directory (the run directory's files/ under gaas up)")
    stripe_api_key: str = setting("GAAS_STRIPE_API_KEY", "", "Stripe's secret key; empty: usage is not sent to "
                                  "Stripe (gaas status says so)")
    stripe_api_base: str = setting("GAAS_STRIPE_API_BASE", "https://api.stripe.com", "Stripe's API address")
    stripe_window_seconds: float = setting("GAAS_STRIPE_WINDOW_SECONDS", 3600.0,
                                           "usage is reported to Stripe per window of this many seconds")
    stripe_grace_seconds: float = setting("GAAS_STRIPE_GRACE_SECONDS", 120.0,
                                          "... once the window closed this many seconds ago")
    stripe_rate: int = setting("GAAS_STRIPE_RATE", 100, "most meter events sent per second (Stripe allows ~1000 in "
                               "live mode)")
