"""The scheduler of each named profile (gaas/settings/router.py declares the profiles and their weights)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gaas.settings.router import PROFILES, parse_weights
from services.router.scheduling.filters.adapter import AdapterFilter
from services.router.scheduling.filters.context_fit import ContextFitFilter
from services.router.scheduling.filters.breaker import BreakerFilter
from services.router.scheduling.filters.not_tried import NotTriedFilter
from services.router.scheduling.filters.model import ModelFilter
from services.router.scheduling.filters.saturation import SaturationFilter
from services.router.scheduling.filters.window import WindowFilter
from services.router.scheduling.pickers.max_score import MaxScorePicker
from services.router.scheduling.pickers.round_robin import RoundRobinPicker
from services.router.scheduling.scheduler import Scheduler
from services.router.scheduling.scorers.adapter_affinity import AdapterAffinityScorer
from services.router.scheduling.scorers.device_memory import DeviceMemoryScorer
from services.router.scheduling.scorers.kv_usage import KVUsageScorer
from services.router.scheduling.scorers.prefix import PrefixScorer
from services.router.scheduling.scorers.queue import QueueScorer
from services.router.scheduling.scorers.session import SessionScorer

SCORERS = {s.name: s for s in (PrefixScorer, QueueScorer, KVUsageScorer, DeviceMemoryScorer, SessionScorer,
                                AdapterAffinityScorer)}
# The profiles (profile -> scorer weights, picker), the scorers' names and the weights' parser are
# gaas/settings/router.py's: what GAAS_ROUTER_POLICY and GAAS_ROUTER_WEIGHTS accept.
# (tests/settings checks SCORER_NAMES names every scorer here.)

__all__ = ["PROFILES", "SCORERS", "make_scheduler", "parse_weights"]


def make_scheduler(
    profile: str,
    weights: Mapping[str, float] | None = None,
    observe: Callable[[str, float], None] = lambda plugin, seconds: None,
) -> Scheduler:
    """The scheduler of a named profile; weights override (or add) its scorers' weights."""
    try:
        defaults, picker = PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown routing policy {profile!r}; choose one of {', '.join(PROFILES)}") from None
    merged = {**defaults, **(weights or {})}
    filters = [ModelFilter(), NotTriedFilter(), BreakerFilter(), ContextFitFilter(), AdapterFilter(), WindowFilter()]
    if picker != "round_robin":
        filters.append(SaturationFilter())
    scorers = [(SCORERS[name](), w) for name, w in merged.items()]
    return Scheduler(
        profile, filters, scorers, RoundRobinPicker() if picker == "round_robin" else MaxScorePicker(), observe
    )
