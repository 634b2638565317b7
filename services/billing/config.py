"""Billing settings, read once at start-up from GAAS_* variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gaas.runtime.envconfig import base_settings, env_str


@dataclass(frozen=True, slots=True)
class BillingConfig:
    instance: str
    host: str
    port: int
    # /metrics port, or -1 for none.
    metrics_port: int
    grace_seconds: float
    # The usage ledger: sqlite:///path or postgresql://...
    database_url: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "BillingConfig":
        return cls(
            **base_settings(env, "billing-0", 50091),
            database_url=env_str(env, "GAAS_BILLING_DATABASE_URL", "sqlite:///.gaas/billing.db"),
        )
