"""The router's settings the CLI needs, read from the router service itself: the one place in
gaas/cli that imports services/ (which the layering forbids a CLI to do). They belong in
gaas/settings; when the per-service settings move there, these two functions read them from it.

Each import is made when the function is called, so commands that need neither never load the router.
"""

from __future__ import annotations


def router_policies() -> dict:
    """The routing policies `gaas up --router-policy` accepts (by name, in the order to list them)."""
    from services.router.scheduling.profiles import PROFILES

    return PROFILES


def registry_refresh_seconds() -> float:
    """How often a router re-reads control's registry of workers (its default)."""
    from services.router.config import REGISTRY_REFRESH_SECONDS

    return REGISTRY_REFRESH_SECONDS
