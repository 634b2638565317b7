"""The roll-out state machine and its SLO guard, driven by a fake clock and fake traffic: each second
a fixed number of requests end, the canary taking its current weight's share of them (as the routers'
split gives it), each version with its own TTFT, error rate and decoding speed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gaas.contracts import errors
from gaas.contracts.rollout import GuardPolicy, RolloutPolicy, State, Strategy
from services.control.rollout.figures import Figures, Outcome, Window, p95
from services.control.rollout.guard import judge
from services.control.rollout.machine import Rollout

GUARD = GuardPolicy(ttft_targets_ms={"gold": 500, "silver": 1500})


@dataclass(frozen=True)
class Behaviour:
    ttft_ms: float = 200.0
    error_rate: float = 0.0
    tokens_per_s: float = 100.0


GOOD = Behaviour()


def rollout(strategy=Strategy.CANARY, hold_s=60.0, **kw) -> Rollout:
    return Rollout("m", stable="1", version="2", policy=RolloutPolicy(strategy=strategy, hold_s=hold_s, guard=GUARD, **kw),
                   now=0.0)


def drive(r: Rollout, window: Window, start: float, until: float, canary: Behaviour = GOOD, stable: Behaviour = GOOD,
          rps: int = 40, ready: bool = True, failed: str = "", tier: str = "gold") -> list[tuple[float, State, int]]:
    """Ticks every second from start to until; returns each change (time, state, weight)."""
    changes = []
    credit = 0
    served = {"1": 0, "2": 0}
    t = start
    while t < until:
        t += 1.0
        split = r.split()
        for i in range(rps):
            credit += split.weight
            version, b = ("2", canary) if credit >= 100 else ("1", stable)
            credit -= 100 if credit >= 100 else 0
            if split.shadow and i % (100 // split.shadow) == 0:
                served["2"] += 1
                window.add(outcome(t, "2", canary, served["2"], tier))
            served[version] += 1
            window.add(outcome(t, version, b, served[version], tier))
        d = r.tick(t, ready, window, failed)
        if d:
            changes.append((t, d.state, d.weight))
    return changes


def outcome(t: float, version: str, b: Behaviour, nth: int, tier: str) -> Outcome:
    """The nth request version served: every (1 / error_rate)th fails."""
    failed = b.error_rate and (nth % round(1 / b.error_rate) == 0)
    return Outcome(at=t, version=version, tier=tier, ok=not failed, ttft_ms=None if failed else b.ttft_ms,
                   output_tokens=0 if failed else 101, decode_s=100 / b.tokens_per_s)


def test_a_healthy_canary_steps_up_each_hold_and_is_promoted():
    r, w = rollout(), Window(60)
    changes = drive(r, w, 0, 300)
    assert [(s, wt) for _, s, wt in changes] == [
        (State.PROGRESSING, 5), (State.PROGRESSING, 25), (State.PROGRESSING, 50), (State.PROGRESSING, 100),
        (State.PROMOTED, 100)]
    assert [t for t, *_ in changes] == [1, 61, 121, 181, 241]
    assert r.split().stable == "2" and not r.split().canary
    assert all(d.reason for d in r.decisions)


@pytest.mark.parametrize("canary, stable, why", [
    (Behaviour(ttft_ms=900), GOOD, "TTFT p95 for gold is 900 ms over 10 requests, past the tier's 500 ms target"),
    (Behaviour(error_rate=0.1), GOOD, "error rate is 10.0%"),
    (Behaviour(tokens_per_s=50), GOOD, "decodes 50 tokens/s, below the stable version's 100"),
])
def test_a_bad_canary_is_back_at_0_within_30_s_with_its_reason(canary, stable, why):
    r, w = rollout(), Window(60)
    changes = drive(r, w, 0, 120, canary=canary, stable=stable)
    assert changes[0][1:] == (State.PROGRESSING, 5)
    t, state, weight = changes[-1]
    assert (state, weight) == (State.ROLLED_BACK, 0)
    assert t - changes[0][0] <= 30, "at 40 requests/s the canary's 5% is 2 a second: 10 samples in 5 s"
    assert why in r.decisions[-1].reason
    assert r.decisions[-1].figures["new"]["requests"] > 0
    split = r.split()
    assert (split.stable, split.canary, split.weight) == ("1", "", 0)


def test_a_breach_at_a_later_step_rolls_back_from_there():
    r, w = rollout(), Window(60)
    drive(r, w, 0, 70)
    assert (r.state, r.weight) == (State.PROGRESSING, 25)
    changes = drive(r, w, 70, 100, canary=Behaviour(ttft_ms=2000))
    assert changes[-1][1:] == (State.ROLLED_BACK, 0) and changes[-1][0] <= 72


def test_no_breach_when_the_stable_version_misses_the_target_too():
    slow = Behaviour(ttft_ms=800)
    r, w = rollout(), Window(60)
    changes = drive(r, w, 0, 70, canary=slow, stable=slow)
    assert [c[1:] for c in changes] == [(State.PROGRESSING, 5), (State.PROGRESSING, 25)]


def test_too_little_traffic_holds_the_step_until_the_guard_can_judge():
    r, w = rollout(), Window(60)
    changes = drive(r, w, 0, 200, rps=2)
    assert [c[1:] for c in changes] == [(State.PROGRESSING, 5)], "a 5% of 2 requests/s never makes 10 samples"


def test_a_version_whose_workers_fail_halts_and_the_stable_keeps_serving():
    r, w = rollout(), Window(60)
    changes = drive(r, w, 0, 5, ready=False, failed="engine exited with 1: weights not found")
    assert changes == [(1.0, State.HALTED, 0)]
    assert "weights not found" in r.decisions[-1].reason
    assert r.split().stable == "1" and not r.split().canary


def test_a_version_not_ready_in_time_halts():
    r, w = rollout(start_timeout_s=30), Window(60)
    changes = drive(r, w, 0, 40, ready=False)
    assert changes == [(30.0, State.HALTED, 0)]
    assert "not ready within 30 s" in r.decisions[-1].reason


def test_blue_green_switches_all_at_once_and_keeps_the_old_warm_until_finished():
    r, w = rollout(Strategy.BLUE_GREEN), Window(60)
    changes = drive(r, w, 0, 200)
    assert changes == [(1.0, State.SWITCHED, 100)], "healthy, it waits for the operator"
    assert r.split().versions == ("1", "2") and r.split().weight == 100
    r.promote(200)
    assert r.state is State.PROMOTED and r.split().versions == ("2",)


def test_blue_green_switches_back_at_a_breach():
    r, w = rollout(Strategy.BLUE_GREEN), Window(60)
    changes = drive(r, w, 0, 30, canary=Behaviour(ttft_ms=700))
    assert changes[-1][1:] == (State.ROLLED_BACK, 0) and changes[-1][0] <= 2
    assert "past the tier's 500 ms target" in r.decisions[-1].reason


def test_shadow_copies_a_share_and_is_promoted_into_a_canary():
    r, w = rollout(Strategy.SHADOW, shadow=10), Window(60)
    assert drive(r, w, 0, 100) == [(1.0, State.SHADOWING, 0)]
    split = r.split()
    assert (split.weight, split.shadow) == (0, 10)
    r.promote(100)
    assert (r.state, r.weight, r.split().shadow) == (State.PROGRESSING, 5, 0)
    assert drive(r, w, 100, 165)[-1][1:] == (State.PROGRESSING, 25)


def test_a_shadow_that_breaches_is_rolled_back():
    r, w = rollout(Strategy.SHADOW, shadow=25), Window(60)
    changes = drive(r, w, 0, 30, canary=Behaviour(error_rate=0.25))
    assert changes[-1][1:] == (State.ROLLED_BACK, 0)


def test_a_pause_holds_the_weight_but_not_against_a_breach():
    r, w = rollout(), Window(60)
    drive(r, w, 0, 10)
    r.pause(10)
    assert drive(r, w, 10, 200) == [], "paused: no step up"
    assert (r.state, r.weight) == (State.PAUSED, 5)
    r.resume(200)
    assert r.state is State.PROGRESSING
    assert drive(r, w, 200, 265)[-1][1:] == (State.PROGRESSING, 25), "the hold starts again at the resume"
    r.pause(265)
    assert drive(r, w, 265, 300, canary=Behaviour(ttft_ms=3000))[-1][1:] == (State.ROLLED_BACK, 0)


@pytest.mark.parametrize("command", ["pause", "promote", "undo"])
def test_an_ended_rollout_refuses_the_operator(command):
    r, w = rollout(), Window(60)
    drive(r, w, 0, 2)
    r.undo(2)
    assert r.state is State.ROLLED_BACK and r.decisions[-1].reason == "rolled back by the operator"
    with pytest.raises(errors.FailedPrecondition, match="has ended"):
        getattr(r, command)(3)


def test_commands_that_do_not_fit_the_state_are_refused():
    r = rollout()
    with pytest.raises(errors.FailedPrecondition, match="still starting"):
        r.pause(0)
    with pytest.raises(errors.FailedPrecondition, match="not paused"):
        r.resume(0)
    with pytest.raises(errors.InvalidArgument, match="already the stable version"):
        Rollout("m", "1", "1", RolloutPolicy(guard=GUARD), now=0)
    with pytest.raises(ValueError, match="must end at 100"):
        RolloutPolicy(steps=(5, 50))
    with pytest.raises(ValueError, match="must rise"):
        RolloutPolicy(steps=(50, 5, 100))


def test_status_shows_weights_figures_and_decisions():
    r, w = rollout(), Window(60)
    drive(r, w, 0, 30)
    s = r.status(30, w)
    assert (s["state"], s["weight"], s["steps"]) == ("progressing", 5, [5, 25, 50, 100])
    assert s["figures"]["2"]["requests"] > 0 and s["figures"]["1"]["ttft_p95_ms"]["gold"]["p95"] == 200
    assert [d["state"] for d in s["decisions"]] == ["starting", "progressing"]


@pytest.mark.parametrize("values, expected", [([], 0.0), ([5], 5), (list(range(1, 101)), 95), (list(range(1, 21)), 19)])
def test_p95_is_the_nearest_rank(values, expected):
    assert p95(values) == expected


def test_the_window_forgets_what_is_older_than_it():
    w = Window(10)
    w.add(Outcome(at=0, version="1", tier="gold", ttft_ms=100))
    w.add(Outcome(at=5, version="1", tier="gold", ok=False))
    assert w.figures(9, "1").requests == 2
    assert w.figures(12, "1") == Figures(requests=1, errors=1)


def test_the_guard_waits_for_enough_requests_before_it_judges():
    few = Figures(requests=5, ttft_p95={"gold": (900, 5)})
    assert judge(GUARD, few, None) == judge(GUARD, Figures(), None)
    assert not judge(GUARD, few, None).judged
    many = Figures(requests=40, ttft_p95={"gold": (300, 40)}, tokens_per_s=90)
    assert judge(GUARD, many, Figures(requests=400, ttft_p95={"gold": (280, 400)}, tokens_per_s=100)).healthy
    assert not judge(GUARD, Figures(requests=40, ttft_p95={"bronze": (9000, 40)}), None).breach, "no target: not judged"


def test_no_breach_when_the_stable_version_is_as_slow_but_a_breach_when_far_slower():
    """Both past the target: the load is to blame unless the new version is worse than the stable
    one by more than the tolerance."""
    slow = Figures(requests=40, ttft_p95={"gold": (800, 40)})
    assert not judge(GUARD, Figures(requests=40, ttft_p95={"gold": (900, 40)}), slow).breach
    assert "the stable version's: 800 ms" in judge(GUARD, Figures(requests=40, ttft_p95={"gold": (1200, 40)}), slow).breach


@pytest.mark.parametrize("t", [0, 10, 70, 130])
def test_a_rollout_persisted_mid_way_goes_on_where_it_was(t):
    """What control stores (as_dict) and another replica drives on (from_dict): the same decisions."""
    a, w = rollout(), Window(60)
    drive(a, w, 0, t)
    b = Rollout.from_dict(a.as_dict())
    assert b.as_dict() == a.as_dict()
    wa, wb = Window(60), Window(60)
    assert drive(a, wa, t, t + 200) == drive(b, wb, t, t + 200)
