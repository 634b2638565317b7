"""The autoscalers as control's leader runs them, against a real Redis and a SQLite deployment with
a fake clock and a fake registry: load reports scale a pool up (ListPools says so, with the reason),
an idle pool with min 0 goes to zero and a request waiting at a router brings it back, a tier's
TTFT p95 past its target (the outcomes routers append) asks for a worker more, and a new leader
starts from the count last saved. A pool declared with replicas is never touched."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gaas.contracts.autoscale import DEMAND_KEY
from gaas.contracts.rollout import OUTCOMES_STREAM, Outcome
from gaas.settings.deployspec import parse_text
from services.control.deployment import Deployment
from services.control.registry import SERVING
from services.control.rollout.driver import Driver
from services.control.scaling import Autoscalers
from tests.fakeclock import FakeClock

FILE = "/srv/deploy/gaas.yaml"
TEXT = """\
models:
  - name: tiny
    version: "1"
    source: /m/tiny
    default: true
    autoscale: {min: %(min)d, max: 3, target_requests: 4, up_after_seconds: 2, down_after_seconds: 10,
                cooldown_seconds: 5, zero_after_seconds: 20}
  - name: fixed
    version: "1"
    source: /m/fixed
    replicas: 1
qos:
  gold: {ttft_target_ms: 100}
"""


@dataclass
class Worker:
    model: str = "tiny"
    model_version: str = "1"
    state: str = SERVING
    load: dict = field(default_factory=dict)


@dataclass
class FakeRegistry:
    workers: list[Worker] = field(default_factory=list)

    async def list(self, model: str = "") -> list[Worker]:
        return [w for w in self.workers if not model or w.model == model]

    def run(self, n: int, running: int = 0) -> None:
        """n serving workers of tiny, running requests spread over them."""
        self.workers = [Worker(load={"running_requests": running // n}) for _ in range(n)]


@pytest.fixture
async def setup(sql_deployment, redis):
    deployment, clock = sql_deployment
    registry = FakeRegistry()
    await redis.delete("gaas:rollout:leader", DEMAND_KEY.format("tiny"), OUTCOMES_STREAM)

    async def apply(min_: int = 1) -> None:
        await deployment.apply(parse_text(TEXT % {"min": min_}, Path("/srv"), FILE), FILE, "test")

    def driver(instance: str = "control-0") -> Driver:
        return Driver(deployment, registry, redis, instance, clock=clock,
                      autoscalers=Autoscalers(deployment, registry, redis))

    yield deployment, registry, clock, apply, driver


async def replicas(deployment: Deployment) -> dict[str, tuple[int, str]]:
    return {p.model: (int(p.spec["replicas"]), p.reason) for p in await deployment.pools()}


async def looks(driver: Driver, clock: FakeClock, seconds: int) -> None:
    for _ in range(seconds):
        clock.advance(1)
        await driver.once()


async def test_load_past_the_target_adds_workers_one_cooldown_apart_and_says_why(setup):
    deployment, registry, clock, apply, driver = setup
    await apply()
    assert await replicas(deployment) == {"tiny": (1, ""), "fixed": (1, "")}, "an autoscaled pool starts at min"
    d = driver()
    registry.run(1, running=12)  # 12 requests on one worker, target 4
    await looks(d, clock, 6)
    n, reason = (await replicas(deployment))["tiny"]
    assert n == 2 and "12.0 requests per serving worker, over the target 4" in reason
    await looks(d, clock, 3)
    assert (await replicas(deployment))["tiny"][0] == 2, "no second change while the new worker starts"
    registry.run(2, running=12)
    await looks(d, clock, 6)
    assert (await replicas(deployment))["tiny"][0] == 3
    assert (await replicas(deployment))["fixed"] == (1, ""), "a pool with fixed replicas is never scaled"
    history = await deployment.scale_decisions("tiny")
    assert [h["replicas"] for h in history] == [3, 2]


async def test_an_idle_pool_goes_to_zero_and_a_waiting_request_brings_it_back_at_once(setup, redis):
    deployment, registry, clock, apply, driver = setup
    await apply(min_=0)
    d = driver()
    registry.run(1)
    await looks(d, clock, 26)
    n, reason = (await replicas(deployment))["tiny"]
    assert n == 0 and "idle for 20 s" in reason
    registry.workers = []
    await looks(d, clock, 3)
    assert (await replicas(deployment))["tiny"][0] == 0
    await redis.set(DEMAND_KEY.format("tiny"), "1", px=10_000)  # what a router sets while a request waits
    await looks(d, clock, 1)
    n, reason = (await replicas(deployment))["tiny"]
    assert n == 1 and "a request waits" in reason


async def test_a_pool_that_starts_at_zero_gets_its_first_worker_when_a_request_waits(setup, sql_deployment, redis):
    deployment, registry, clock, _, driver = setup
    text = TEXT.replace("min: %(min)d, max: 3", "min: 0, max: 3, initial_scale: 0")
    await deployment.apply(parse_text(text, Path("/srv"), FILE), FILE, "test")
    assert (await replicas(deployment))["tiny"] == (0, "")
    d = driver()
    await looks(d, clock, 3)
    assert (await replicas(deployment))["tiny"][0] == 0, "no request, no worker"
    await redis.set(DEMAND_KEY.format("tiny"), "1", px=10_000)
    await looks(d, clock, 1)
    n, reason = (await replicas(deployment))["tiny"]
    assert n == 1 and "a request waits" in reason


async def test_a_tiers_ttft_past_its_target_asks_for_a_worker_more(setup, redis):
    deployment, registry, clock, apply, driver = setup
    await apply()
    d = driver()
    registry.run(1, running=1)
    await d.once()
    rows = [Outcome(at=clock(), version="1", tier="gold", ok=True, ttft_ms=400, output_tokens=5, decode_s=0.1,
                    model="tiny").encode() for _ in range(30)]
    await redis.xadd(OUTCOMES_STREAM, {"o": json.dumps(rows)})
    await looks(d, clock, 6)
    n, reason = (await replicas(deployment))["tiny"]
    assert n == 2 and "gold TTFT p95 400 ms over 30 requests, past its 100 ms target" in reason


async def test_a_new_leader_starts_from_the_count_last_saved_and_scales_in_after_its_window(setup, redis):
    deployment, registry, clock, apply, driver = setup
    await apply()
    registry.run(1, running=12)
    await looks(driver("control-0"), clock, 6)
    assert (await replicas(deployment))["tiny"][0] == 2
    await redis.delete("gaas:rollout:leader")  # control-0 went away
    registry.run(2, running=0)
    d = driver("control-1")
    await looks(d, clock, 9)
    assert (await replicas(deployment))["tiny"][0] == 2, "down only after down_after_seconds of fitting fewer"
    await looks(d, clock, 8)
    n, reason = (await replicas(deployment))["tiny"]
    assert n == 1 and "fit in 1 worker(s)" in reason


async def test_a_file_changing_the_bounds_is_a_scale_change_and_clamps_the_count(setup):
    deployment, registry, clock, apply, driver = setup
    await apply()
    registry.run(1, running=12)
    d = driver()
    await looks(d, clock, 6)
    assert (await replicas(deployment))["tiny"][0] == 2
    changes = await deployment.apply(parse_text((TEXT % {"min": 1}).replace("max: 3", "max: 1"), Path("/srv"), FILE),
                                     FILE, "test")
    assert any(c.kind == "scaled" and "1-1 workers on load" in c.detail for c in changes[1])
    assert (await replicas(deployment))["tiny"][0] == 1
