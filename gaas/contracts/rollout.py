"""A model's roll-out, as control decides it and routers apply it: which versions serve, what
share of new requests each gets, what share is mirrored to a version under watch, and which
tenants are pinned to a version. One definition for control's rollout machine
(services/control/rollout/), the routers' choice of version (services/router/versions.py) and
`gaas rollout status`.

Weights are whole percent. A request goes to the canary with the split's weight, to the stable
version otherwise; a tenant pinned to a serving version always goes there; a session's turns stay
on the version its first turn took while that version serves. Shadow requests are copies: their
answers are discarded and never billed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Strategy(enum.StrEnum):
    # The new version's weight steps up on its own (for example 5 -> 25 -> 50 -> 100) while the
    # guard finds it as good as the stable one; a breach sends it back to 0 at once.
    CANARY = "canary"
    # All new requests switch at once when the new version's workers are ready; the old ones
    # stay warm (a breach, or `gaas rollout undo`, switches back) until the roll-out is finished.
    BLUE_GREEN = "blue-green"
    # A share of requests is copied to the new version (answers discarded, never billed) and
    # its figures reported; no tenant's answer comes from it until it is promoted.
    SHADOW = "shadow"


class State(enum.StrEnum):
    # The new version's workers are starting; it takes nothing yet.
    STARTING = "starting"
    # Canary: taking its current step's weight.
    PROGRESSING = "progressing"
    # Blue-green: taking every new request, the old version kept warm.
    SWITCHED = "switched"
    # Shadow: taking copies only.
    SHADOWING = "shadowing"
    # Held at its weight by the operator; the guard still rolls it back on a breach.
    PAUSED = "paused"
    # Ends. Promoted: the new version is the stable one (the old one drains). Rolled back: the
    # stable one takes everything again (the new one drains). Halted: the new version never got
    # ready (its workers failed to start, or took too long); the stable one kept serving.
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled-back"
    HALTED = "halted"

    @property
    def ended(self) -> bool:
        return self in (State.PROMOTED, State.ROLLED_BACK, State.HALTED)


PERCENT = 100


@dataclass(frozen=True, slots=True)
class Split:
    """How one model's new requests are shared between its versions now."""

    model: str
    stable: str
    # The version rolled out ("" when none is).
    canary: str = ""
    # Percent of new requests the canary takes, and percent of requests copied to it (shadow).
    weight: int = 0
    shadow: int = 0
    # Tenants that always take a given version (while it serves).
    pins: Mapping[str, str] = field(default_factory=dict)
    # Versions that serve only the tenants pinned to them (kept past their roll-out for those).
    kept: tuple[str, ...] = ()
    # Version -> the only tenants that may use it (a version not listed: every tenant).
    tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stable:
            raise ValueError(f"{self.model}: a split needs its stable version")
        for what, pct in (("weight", self.weight), ("shadow", self.shadow)):
            if not 0 <= pct <= PERCENT:
                raise ValueError(f"{self.model}: {what} must be 0..{PERCENT}, not {pct}")
        if self.canary == self.stable:
            raise ValueError(f"{self.model}: canary and stable are both version {self.stable}")
        if not self.canary and (self.weight or self.shadow):
            raise ValueError(f"{self.model}: a weight or shadow share needs a canary version")

    def serves(self, version: str) -> bool:
        """Whether new requests may go to version (shadow copies and pins aside)."""
        if version == self.stable:
            return self.weight < PERCENT
        return bool(version) and version == self.canary and self.weight > 0

    def may_use(self, tenant: str, version: str) -> bool:
        """Whether tenant may be served by version (the version's pool lists its tenants, or not)."""
        allowed = self.tenants.get(version)
        return not allowed or tenant in allowed

    @property
    def versions(self) -> tuple[str, ...]:
        """The versions whose workers must be kept: the stable one, the canary while rolled out,
        and those kept for pinned tenants."""
        live = (self.stable, self.canary) if self.canary else (self.stable,)
        return live + tuple(v for v in self.kept if v not in live)

    @classmethod
    def single(cls, model: str, version: str) -> Split:
        """One version taking everything: a model with no roll-out."""
        return cls(model=model, stable=version)

    def as_dict(self) -> dict:
        return {"model": self.model, "stable": self.stable, "canary": self.canary, "weight": self.weight,
                "shadow": self.shadow, "pins": dict(self.pins), "kept": list(self.kept),
                "tenants": {v: sorted(t) for v, t in self.tenants.items()}}


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    """What the SLO guard (services/control/rollout/guard.py) holds a new version to."""

    # tier -> the TTFT p95 it is promised, ms: deploy/gaas.yaml's qos targets, unless the model's
    # rollout.guard.ttft_p95_ms names its own.
    ttft_targets_ms: Mapping[str, float] = field(default_factory=dict)
    # The sliding window the figures are taken over, s.
    window_s: float = 60.0
    # Requests with a first token a tier needs in the window before its p95 is judged, and
    # requests before the error rate and the decoding rate are.
    min_ttft_samples: int = 10
    min_requests: int = 20
    # How much worse than the stable version the new one may be: its TTFT p95 (a fraction of the
    # stable's), its error rate (absolute), its decoding rate (a fraction of the stable's).
    ttft_tolerance: float = 0.2
    error_margin: float = 0.02
    throughput_tolerance: float = 0.25

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"the guard's window must be positive, not {self.window_s}")
        if self.min_ttft_samples < 1 or self.min_requests < 1:
            raise ValueError("the guard needs at least one request to judge")
        for what, v in (("ttft_tolerance", self.ttft_tolerance), ("error_margin", self.error_margin),
                        ("throughput_tolerance", self.throughput_tolerance)):
            if not 0 <= v <= 10:
                raise ValueError(f"{what} must be between 0 and 10, not {v}")
        for tier, ms in self.ttft_targets_ms.items():
            if not ms > 0:
                raise ValueError(f"the TTFT p95 target of {tier} must be positive, not {ms}")

    def as_dict(self) -> dict:
        return {"ttft_targets_ms": dict(self.ttft_targets_ms), "window_s": self.window_s,
                "min_ttft_samples": self.min_ttft_samples, "min_requests": self.min_requests,
                "ttft_tolerance": self.ttft_tolerance, "error_margin": self.error_margin,
                "throughput_tolerance": self.throughput_tolerance}

    @classmethod
    def from_dict(cls, d: Mapping) -> GuardPolicy:
        return cls(**{**d, "ttft_targets_ms": dict(d.get("ttft_targets_ms") or {})})


@dataclass(frozen=True, slots=True)
class RolloutPolicy:
    """How a model's new version is rolled out (deploy/gaas.yaml, a model's rollout:)."""

    strategy: Strategy = Strategy.CANARY
    # The canary's weights, in percent, the last 100.
    steps: tuple[int, ...] = (5, 25, 50, 100)
    # How long each step holds (healthy) before the next, s; how long the new version's workers
    # may take to get ready, s.
    hold_s: float = 60.0
    start_timeout_s: float = 600.0
    # Percent of requests copied to the new version while shadowing.
    shadow: int = 10
    guard: GuardPolicy = field(default_factory=GuardPolicy)

    def __post_init__(self) -> None:
        if not self.steps or self.steps[-1] != PERCENT:
            raise ValueError(f"a canary's steps must end at {PERCENT}, not {list(self.steps)}")
        if any(not 0 < s <= PERCENT for s in self.steps) or list(self.steps) != sorted(set(self.steps)):
            raise ValueError(f"a canary's steps must rise within 1..{PERCENT}: {list(self.steps)}")
        if not 0 < self.shadow <= PERCENT:
            raise ValueError(f"the shadow share must be 1..{PERCENT}, not {self.shadow}")
        if self.hold_s < 0 or self.start_timeout_s <= 0:
            raise ValueError("hold and start timeout must be positive")

    def as_dict(self) -> dict:
        return {"strategy": str(self.strategy), "steps": list(self.steps), "hold_s": self.hold_s,
                "start_timeout_s": self.start_timeout_s, "shadow": self.shadow, "guard": self.guard.as_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> RolloutPolicy:
        return cls(strategy=Strategy(d["strategy"]), steps=tuple(d["steps"]), hold_s=float(d["hold_s"]),
                   start_timeout_s=float(d["start_timeout_s"]), shadow=int(d["shadow"]),
                   guard=GuardPolicy.from_dict(d.get("guard") or {}))


# Where routers append the outcomes of the requests of models under a roll-out, and the control
# plane's roll-out driver reads them (a Redis stream, trimmed to about OUTCOMES_KEPT entries).
OUTCOMES_STREAM = "gaas:rollout:outcomes"
OUTCOMES_KEPT = 20_000
# The leader among control replicas that drives roll-outs (a Redis key with a TTL).
LEADER_KEY = "gaas:rollout:leader"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's end, as a router reports it to the roll-out guard."""

    # When it ended (seconds, the wall clock), the version that served it, the tenant's tier.
    at: float
    version: str
    tier: str
    # Whether it was served (a failure the client saw is not).
    ok: bool = True
    # Time to first token, ms (None: no token came), output tokens, and the seconds from the
    # first token to the last.
    ttft_ms: float | None = None
    output_tokens: int = 0
    decode_s: float = 0.0
    model: str = ""
    # A copy (shadow traffic): its answer went nowhere, and nobody paid for it.
    shadow: bool = False

    def encode(self) -> list:
        return [self.model, self.version, self.tier, int(self.ok), self.ttft_ms, self.output_tokens,
                round(self.decode_s, 4), round(self.at, 3), int(self.shadow)]

    @classmethod
    def decode(cls, row: list) -> Outcome:
        model, version, tier, ok, ttft, tokens, decode_s, at, shadow = row
        return cls(at=float(at), version=str(version), tier=str(tier), ok=bool(ok),
                   ttft_ms=None if ttft is None else float(ttft), output_tokens=int(tokens), decode_s=float(decode_s),
                   model=str(model), shadow=bool(shadow))
