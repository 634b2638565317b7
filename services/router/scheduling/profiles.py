"""Named scheduling profiles, and the weights their scorers get (overridable from config)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from services.router.scheduling.filters.context_fit import ContextFitFilter
from services.router.scheduling.filters.breaker import BreakerFilter
from services.router.scheduling.filters.not_tried import NotTriedFilter
from services.router.scheduling.filters.model import ModelFilter
from services.router.scheduling.filters.saturation import SaturationFilter
from services.router.scheduling.filters.window import WindowFilter
from services.router.scheduling.pickers.max_score import MaxScorePicker
from services.router.scheduling.pickers.round_robin import RoundRobinPicker
from services.router.scheduling.scheduler import Scheduler
from services.router.scheduling.scorers.device_memory import DeviceMemoryScorer
from services.router.scheduling.scorers.kv_usage import KVUsageScorer
from services.router.scheduling.scorers.prefix import PrefixScorer
from services.router.scheduling.scorers.queue import QueueScorer
from services.router.scheduling.scorers.session import SessionScorer

SCORERS = {s.name: s for s in (PrefixScorer, QueueScorer, KVUsageScorer, DeviceMemoryScorer, SessionScorer)}

# profile -> (scorer weights, picker). Every profile filters by model, failures, circuit breakers,
# context and batching windows.
PROFILES: dict[str, tuple[dict[str, float], str]] = {
    "round_robin": ({}, "round_robin"),
    "least_load": ({"queue": 2.0, "kv_usage": 1.0}, "max_score"),
    # Where the prefix lives, unless load says otherwise: a full prefix outweighs a moderate queue
    # (the engine skips that prefill), a long one does not, and saturated workers are filtered out.
    # A session's turn also leans to the worker of its last turn (what the directory may not know yet).
    "kv_aware": ({"prefix": 3.0, "queue": 2.0, "kv_usage": 0.5, "device_memory": 0.25, "session": 1.0}, "max_score"),
}


def parse_weights(spec: str) -> dict[str, float]:
    """'prefix=3,queue=2' -> {'prefix': 3.0, 'queue': 2.0}; ValueError naming what is wrong."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r} in the weights; scorers: {', '.join(SCORERS)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"the weight of {name} must be a number, got {value!r}") from None
    return out


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
    filters = [ModelFilter(), NotTriedFilter(), BreakerFilter(), ContextFitFilter(), WindowFilter()]
    if picker != "round_robin":
        filters.append(SaturationFilter())
    scorers = [(SCORERS[name](), w) for name, w in merged.items()]
    return Scheduler(
        profile, filters, scorers, RoundRobinPicker() if picker == "round_robin" else MaxScorePicker(), observe
    )
