"""A pool's autoscaler, table-driven with a fake clock and fake signals: up on load (after its
stabilization), down when the load fits fewer (after its own), never within the cool-down or while
a worker it asked for starts, to zero when idle, back from zero at once for a waiting request."""

from __future__ import annotations

import pytest

from gaas.contracts.autoscale import AutoscalePolicy
from services.control.autoscale import PoolScaler, Signals

POLICY = AutoscalePolicy(min=1, max=3, target_requests=4, up_after_s=5, down_after_s=30, cooldown_s=10,
                         zero_after_s=60)


def run(scaler: PoolScaler, signals, start: float, until: float, step: float = 1.0) -> list[tuple[float, int]]:
    """Looks every step seconds; signals(t, replicas) -> Signals. The changes (time, replicas)."""
    out, t = [], start
    while t < until:
        t += step
        d = scaler.look(t, signals(t, scaler.replicas))
        if d is not None:
            out.append((t, d.replicas))
    return out


def steady(running: int, waiting: int = 0, **kw):
    return lambda t, replicas: Signals(ready=replicas, running=running, waiting=waiting, **kw)


@pytest.mark.parametrize("signals, changes", [
    # 20 requests on one worker (target 4): up once held 5 s and the cool-down (10 s, from the start)
    # is over, then after each cool-down, to max.
    (steady(20), [(10, 2), (20, 3)]),
    # KV-cache use past its target asks for one more too; a tier past its TTFT target also.
    (steady(1, kv_usage=0.95), [(10, 2), (20, 3)]),
    (steady(1, ttft_breach="gold TTFT p95 900 ms past 500"), [(10, 2), (20, 3)]),
    # At the target exactly: nothing.
    (steady(4), []),
])
def test_up_on_load_after_its_window_and_each_cooldown_to_max(signals, changes):
    s = PoolScaler(POLICY, 1, now=0)
    assert run(s, signals, 0, 40) == changes


def test_no_second_worker_while_the_first_one_asked_for_starts():
    s = PoolScaler(POLICY, 1, now=0)
    starting = lambda t, replicas: Signals(ready=1, starting=replicas - 1 if t < 40 else 0, running=20)
    # Up at 10; the load is judged again once the new worker serves (t=40): 5 s more, then up.
    assert run(s, starting, 0, 60) == [(10, 2), (45, 3)]


def test_down_one_at_a_time_when_the_load_fits_fewer_and_never_below_min():
    s = PoolScaler(POLICY, 3, now=0)
    # The window counts from the first look that saw it (t=1), and anew after each change.
    assert run(s, steady(2), 0, 120) == [(31, 2), (62, 1)]
    s = PoolScaler(POLICY, 3, now=0)
    assert run(s, steady(5), 0, 120) == [], "5 requests would not fit 2 workers at half the target"


def test_an_idle_pool_with_min_0_goes_to_zero_and_a_waiting_request_brings_a_worker_at_once():
    policy = AutoscalePolicy(min=0, max=2, target_requests=4, cooldown_s=10, zero_after_s=60)
    s = PoolScaler(policy, 1, now=0)
    assert run(s, steady(0), 0, 100) == [(61, 0)]
    demand = lambda t, replicas: Signals(ready=0, demand=t > 120)
    assert run(s, demand, 100, 125) == [(121, 1)], "no cool-down, no stabilization: a request is waiting"


def test_a_burst_shorter_than_the_window_moves_nothing():
    s = PoolScaler(POLICY, 1, now=0)
    burst = lambda t, replicas: Signals(ready=replicas, running=20 if 12 <= t < 15 else 1)
    assert run(s, burst, 0, 60) == []


def test_the_policy_refuses_what_cannot_scale():
    for kw, message in (({"min": 2, "max": 1}, "min <= max"), ({"min": 0, "max": 0}, "at least 1"),
                        ({"target_requests": 0}, "above 0"), ({"target_kv_usage": 1.5}, r"in \(0, 1\]")):
        with pytest.raises(ValueError, match=message):
            AutoscalePolicy(**kw)


def test_a_worker_slower_to_start_than_zero_after_is_not_sent_away_the_moment_it_serves():
    """The idle clock counts from when the pool serves (CI's first start builds the engine for longer
    than zero_after_s)."""
    policy = AutoscalePolicy(min=0, max=2, zero_after_s=20, cooldown_s=5)
    s = PoolScaler(policy, 1, now=0)
    starting_then_idle = lambda t, replicas: Signals(ready=1 if t >= 50 else 0, starting=0 if t >= 50 else 1)
    assert run(s, starting_then_idle, 0, 80) == [(70, 0)], "idle for 20 s from t=50, not from t=0"
