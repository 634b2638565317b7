"""The scheduler of each named profile (gaas/settings/router.py declares the profiles and their weights)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gaas.settings.router import PROFILES, parse_weights
from services.router.scheduling import registry
from services.router.scheduling.scheduler import Scheduler

# The profiles (their filters, scorer weights and picker, by name), the weights' parser: what
# GAAS_ROUTER_POLICY and GAAS_ROUTER_WEIGHTS accept, gaas/settings/router.py's; the plugins named
# there register themselves (registry.py).
__all__ = ["PROFILES", "make_scheduler", "parse_weights"]


def make_scheduler(
    profile: str,
    weights: Mapping[str, float] | None = None,
    observe: Callable[[str, float], None] = lambda plugin, seconds: None,
    weights_from: str = "the weights",
) -> Scheduler:
    """The scheduler of a named profile; weights (from weights_from, as an error names them)
    override or add its scorers' weights."""
    try:
        p = PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown routing policy {profile!r}; choose one of {', '.join(PROFILES)}") from None
    merged = {**p.weights, **(weights or {})}
    where = f"the {profile} profile"
    filters = [registry.get("filter", name, where)() for name in p.filters]
    scorers = [(registry.get("scorer", name, weights_from if name in (weights or {}) else where)(), w)
               for name, w in merged.items()]
    return Scheduler(profile, filters, scorers, registry.get("picker", p.picker, where)(), observe)
