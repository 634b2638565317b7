"""One model version's roll-out as a state machine (gaas/contracts/rollout.py names the states).

    canary:      starting -> progressing (each step's weight) -> promoted
    blue-green:  starting -> switched (100%, the old version warm) -> promoted   (finish)
    shadow:      starting -> shadowing (copies only) -> progressing ...          (promote)
    any live state -> rolled-back (a breach, or undo), paused <-> its state (pause, resume)
    starting -> halted (its workers failed to start, or were not ready in time)

tick(now, ready, window) is all the machine is driven by besides the operator's commands: the
control plane calls it every second with whether the new version's workers are up and the
outcomes window. A breach rolls back at the tick that sees it; a healthy step steps up once it has
been held hold_s and the guard judged it on enough requests; with too few, it waits. Every change
is a Decision, with its reason and the figures it was made on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gaas.contracts import errors
from gaas.contracts.rollout import PERCENT, RolloutPolicy, Split, State, Strategy
from services.control.rollout.figures import Window
from services.control.rollout.guard import judge

__all__ = ["Decision", "Rollout", "RolloutPolicy"]


@dataclass(frozen=True, slots=True)
class Decision:
    at: float
    state: State
    weight: int
    reason: str
    figures: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"at": self.at, "state": str(self.state), "weight": self.weight, "reason": self.reason,
                "figures": self.figures}

    @classmethod
    def from_dict(cls, d: Mapping) -> Decision:
        return cls(float(d["at"]), State(d["state"]), int(d["weight"]), str(d["reason"]), dict(d.get("figures") or {}))


class Rollout:
    """One roll-out of model from version stable to version. Times are the wall clock's (seconds),
    so a roll-out persisted by one control replica is driven on by another (as_dict, from_dict)."""

    def __init__(self, model: str, stable: str, version: str, policy: RolloutPolicy, now: float) -> None:
        if version == stable:
            raise errors.InvalidArgument(f"{model} {version} is already the stable version")
        self.model, self.stable, self.version = model, stable, version
        self.policy = policy
        self.state = State.STARTING
        self.started_at = now
        self.step = 0
        self.weight = 0
        # When the current weight began (the guard judges only what came after it).
        self.since = now
        self.paused_from: State | None = None
        self.decisions: list[Decision] = [Decision(now, State.STARTING, 0, f"{policy.strategy} of {version} "
                                                   f"over {stable}: starting its workers")]

    # -- what routers apply -------------------------------------------------------------------

    def split(self) -> Split:
        """The split the routers apply now (control adds the pins and tenants of the versions' pools)."""
        if self.state is State.PROMOTED:
            return Split(self.model, stable=self.version)
        if self.state in (State.ROLLED_BACK, State.HALTED):
            return Split(self.model, stable=self.stable)
        shadow = self.policy.shadow if self._live is State.SHADOWING else 0
        return Split(self.model, stable=self.stable, canary=self.version, weight=self.weight, shadow=shadow)

    @property
    def _live(self) -> State:
        return self.paused_from if self.state is State.PAUSED and self.paused_from else self.state

    # -- the clock ----------------------------------------------------------------------------

    def tick(self, now: float, ready: bool, window: Window, failed: str = "") -> Decision | None:
        """One look: ready, whether the new version's workers are up; failed, why they cannot
        start ("" if nothing says so). Returns the decision made, if any."""
        if self.state.ended:
            return None
        if self.state is State.STARTING:
            if failed:
                return self._go(now, State.HALTED, 0, f"{self.version}'s workers failed to start: {failed}")
            if not ready:
                if now - self.started_at >= self.policy.start_timeout_s:
                    return self._go(now, State.HALTED, 0, f"{self.version}'s workers were not ready within "
                                                          f"{self.policy.start_timeout_s:.0f} s")
                return None
            return self._begin(now)
        new = window.figures(now, self.version, since=self.since)
        stable = None if self.weight >= PERCENT else window.figures(now, self.stable, since=self.since)
        verdict = judge(self.policy.guard, new, stable, version=f"{self.model} {self.version}")
        figures = {"new": new.as_dict(), "stable": stable.as_dict() if stable else None}
        if verdict.breach:
            return self._go(now, State.ROLLED_BACK, 0, f"rolled back: {verdict.breach}", figures)
        if self.state is State.PAUSED or self._live is not State.PROGRESSING:
            return None
        if now - self.since < self.policy.hold_s or not verdict.healthy:
            return None
        if self.step + 1 >= len(self.policy.steps):
            return self._go(now, State.PROMOTED, PERCENT, f"promoted: healthy at {self.weight}% for "
                                                          f"{now - self.since:.0f} s", figures)
        self.step += 1
        return self._go(now, State.PROGRESSING, self.policy.steps[self.step],
                        f"healthy at {self.weight}% for {now - self.since:.0f} s", figures)

    def _begin(self, now: float) -> Decision:
        strategy = self.policy.strategy
        if strategy is Strategy.BLUE_GREEN:
            return self._go(now, State.SWITCHED, PERCENT, f"{self.version}'s workers are ready: every new "
                                                          f"request switched to it, {self.stable} kept warm")
        if strategy is Strategy.SHADOW:
            return self._go(now, State.SHADOWING, 0, f"{self.version}'s workers are ready: "
                                                     f"{self.policy.shadow}% of requests copied to it")
        return self._go(now, State.PROGRESSING, self.policy.steps[0], f"{self.version}'s workers are ready")

    def _go(self, now: float, state: State, weight: int, reason: str, figures: dict | None = None) -> Decision:
        if state is not State.PAUSED and (weight != self.weight or state is not self._live):
            self.since = now
        self.state, self.weight = state, weight
        if state is not State.PAUSED:
            self.paused_from = None
        decision = Decision(now, state, weight, reason, figures or {})
        self.decisions.append(decision)
        return decision

    def adopt(self, policy: RolloutPolicy, now: float) -> Decision | None:
        """A new policy for this roll-out (the file changed it; not its strategy): its steps, holds,
        shadow share and guard from now on. A canary past the new steps' last but one stays at its
        weight until the guard steps it to 100."""
        if policy.strategy != self.policy.strategy:
            raise errors.FailedPrecondition(f"{self.model}'s roll-out of {self.version} is a {self.policy.strategy}; "
                                            f"its strategy cannot change under way (undo or promote it first)")
        if policy == self.policy:
            return None
        self.policy = policy
        self.step = min(self.step, len(policy.steps) - 1)
        decision = Decision(now, self.state, self.weight, f"its policy changed: steps {list(policy.steps)}, holds "
                            f"{policy.hold_s:.0f} s, shadow {policy.shadow}%")
        self.decisions.append(decision)
        return decision

    # -- the operator -------------------------------------------------------------------------

    def _live_or_refuse(self, what: str) -> None:
        if self.state.ended:
            raise errors.FailedPrecondition(f"{self.model}'s roll-out of {self.version} has ended ({self.state}); "
                                            f"there is nothing to {what}")

    def pause(self, now: float) -> Decision:
        self._live_or_refuse("pause")
        if self.state is State.PAUSED:
            raise errors.FailedPrecondition(f"{self.model}'s roll-out of {self.version} is already paused")
        if self.state is State.STARTING:
            raise errors.FailedPrecondition(f"{self.version}'s workers are still starting; pause once it serves")
        live = self.state
        decision = self._go(now, State.PAUSED, self.weight, f"paused by the operator at {self.weight}%")
        self.paused_from = live
        return decision

    def resume(self, now: float) -> Decision:
        if self.state is not State.PAUSED or self.paused_from is None:
            raise errors.FailedPrecondition(f"{self.model}'s roll-out of {self.version} is not paused ({self.state})")
        self.since = now
        return self._go(now, self.paused_from, self.weight, "resumed by the operator")

    def promote(self, now: float) -> Decision:
        """Shadowing: start the canary's steps. Otherwise: the new version is the stable one now
        (blue-green's finish; a canary skipping its remaining steps)."""
        self._live_or_refuse("promote")
        if self.state is State.STARTING:
            raise errors.FailedPrecondition(f"{self.version}'s workers are still starting; promote once it serves")
        if self._live is State.SHADOWING:
            self.policy = replace(self.policy, strategy=Strategy.CANARY)
            return self._go(now, State.PROGRESSING, self.policy.steps[0], "shadow promoted to a canary by the operator")
        return self._go(now, State.PROMOTED, PERCENT, "promoted by the operator")

    def undo(self, now: float) -> Decision:
        self._live_or_refuse("undo")
        return self._go(now, State.ROLLED_BACK, 0, "rolled back by the operator")

    def status(self, now: float, window: Window) -> dict:
        """What `gaas rollout status MODEL --json` shows."""
        return {
            "model": self.model, "stable": self.stable, "version": self.version,
            "strategy": str(self.policy.strategy), "state": str(self.state), "weight": self.weight,
            "shadow": self.split().shadow, "step": self.step, "steps": list(self.policy.steps),
            "since": self.since, "started_at": self.started_at,
            "figures": {v: window.figures(now, v, since=self.since).as_dict() for v in (self.stable, self.version)},
            "decisions": [d.as_dict() for d in self.decisions],
        }

    # -- persistence ---------------------------------------------------------------------------

    def as_dict(self) -> dict:
        return {"model": self.model, "stable": self.stable, "version": self.version,
                "policy": self.policy.as_dict(), "state": str(self.state), "started_at": self.started_at,
                "step": self.step, "weight": self.weight, "since": self.since,
                "paused_from": str(self.paused_from) if self.paused_from else None,
                "decisions": [d.as_dict() for d in self.decisions]}

    @classmethod
    def from_dict(cls, d: Mapping) -> Rollout:
        r = cls.__new__(cls)
        r.model, r.stable, r.version = d["model"], d["stable"], d["version"]
        r.policy = RolloutPolicy.from_dict(d["policy"])
        r.state = State(d["state"])
        r.started_at, r.step, r.weight, r.since = float(d["started_at"]), int(d["step"]), int(d["weight"]), float(d["since"])
        r.paused_from = State(d["paused_from"]) if d.get("paused_from") else None
        r.decisions = [Decision.from_dict(x) for x in d["decisions"]]
        return r

