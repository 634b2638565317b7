"""The router's settings the CLI shows: read from gaas/settings/router.py, where the router reads them."""

from __future__ import annotations

from gaas.settings.router import PROFILES, REGISTRY_REFRESH_SECONDS


def router_policies() -> dict:
    """The routing policies `gaas up --router-policy` accepts (by name, in the order to list them)."""
    return PROFILES


def registry_refresh_seconds() -> float:
    """How often a router re-reads control's registry of workers (its default)."""
    return REGISTRY_REFRESH_SECONDS
