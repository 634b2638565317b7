"""The roll-out driver against a real Redis and a SQLite deployment, with a fake clock and a fake
registry: one control replica leads; the outcomes routers append reach the guard; a new version's
workers being ready is what starts its share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gaas.contracts.rollout import OUTCOMES_STREAM, Outcome, State
from gaas.settings.deployspec import parse_text
from services.control.registry import SERVING
from services.control.rollout.driver import Driver
from tests.fakeclock import FakeClock

FILE = "/srv/deploy/gaas.yaml"


def text(version: str) -> str:
    return f"""\
models:
  - name: tiny
    version: "{version}"
    source: /m/tiny
    replicas: 1
    rollout: {{strategy: canary, steps: [50, 100], hold_seconds: 30, guard: {{min_samples: 5, min_requests: 5,
              ttft_p95_ms: {{gold: 100}}}}}}
"""


@dataclass
class Worker:
    model_version: str
    model: str = "tiny"
    state: str = SERVING


@dataclass
class FakeRegistry:
    workers: list[Worker] = field(default_factory=list)

    async def list(self, model: str = "") -> list[Worker]:
        return [w for w in self.workers if not model or w.model == model]


@pytest.fixture
async def setup(sql_deployment, redis):
    # (The clock starts now: a replica that becomes the leader reads the stream from its window's start.)
    deployment, clock = sql_deployment
    registry = FakeRegistry([Worker("1")])
    await deployment.apply(parse_text(text("1"), Path("/srv"), FILE), FILE, "test")
    await deployment.apply(parse_text(text("2"), Path("/srv"), FILE), FILE, "test")
    yield deployment, registry, clock


async def append(redis, clock: FakeClock, version: str, ttft_ms: float, n: int) -> None:
    rows = [Outcome(at=clock(), version=version, tier="gold", ok=True, ttft_ms=ttft_ms, output_tokens=20,
                    decode_s=0.2, model="tiny").encode() for _ in range(n)]
    await redis.xadd(OUTCOMES_STREAM, {"o": json.dumps(rows)})


async def test_one_replica_drives_and_another_takes_over_when_it_goes(setup, redis):
    deployment, registry, clock = setup
    a = Driver(deployment, registry, redis, "control-0", clock=clock)
    b = Driver(deployment, registry, redis, "control-1", clock=clock)
    await a.once()
    await b.once()
    assert (a._leading, b._leading) == (True, False)
    await redis.delete("gaas:rollout:leader")  # control-0's claim lapsed (it died)
    await b.once()
    assert b._leading


async def test_the_new_versions_share_starts_once_its_workers_are_ready(setup, redis):
    deployment, registry, clock = setup
    driver = Driver(deployment, registry, redis, "control-0", clock=clock)
    await driver.once()
    assert (await deployment.rollout("tiny"))[0].state is State.STARTING
    registry.workers.append(Worker("2"))
    clock.advance(1)
    await driver.once()
    r, _ = await deployment.rollout("tiny")
    assert (r.state, r.weight) == (State.PROGRESSING, 50)


async def test_outcomes_appended_by_routers_reach_the_guard_which_rolls_back_a_slow_version(setup, redis):
    deployment, registry, clock = setup
    registry.workers.append(Worker("2"))
    driver = Driver(deployment, registry, redis, "control-0", clock=clock)
    await driver.once()  # progressing at 50%
    clock.advance(1)
    await append(redis, clock, "1", 40, 10)
    await append(redis, clock, "2", 400, 10)
    clock.advance(1)
    await driver.once()
    r, _ = await deployment.rollout("tiny")
    assert r.state is State.ROLLED_BACK and "TTFT p95 for gold is 400 ms" in r.decisions[-1].reason
    await driver.once()
    assert driver.window("tiny") is None, "an ended roll-out's window is let go at the next look"


async def test_a_new_leader_reads_the_last_windows_outcomes_first(setup, redis):
    deployment, registry, clock = setup
    registry.workers.append(Worker("2"))
    await Driver(deployment, registry, redis, "control-0", clock=clock).once()
    clock.advance(1)
    await append(redis, clock, "1", 40, 10)
    await append(redis, clock, "2", 400, 10)
    await redis.delete("gaas:rollout:leader")
    clock.advance(1)
    await Driver(deployment, registry, redis, "control-1", clock=clock).once()
    assert (await deployment.rollout("tiny"))[0].state is State.ROLLED_BACK
