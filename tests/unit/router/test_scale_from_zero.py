"""A request for an autoscaled model no worker serves waits at the router, telling the autoscaler
(a Redis key per model, its TTL), and goes on once a worker serves; past its tier's queue timeout
it gets UNAVAILABLE with a Retry-After that says to come back. A model that is not autoscaled is
refused at once, as before."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Gauge

from gaas.contracts import errors
from gaas.contracts.autoscale import DEMAND_KEY
from gaas.contracts.principal import Principal
from services.router import prepare
from services.router.demand import Demand
from services.router.directory import MeshDirectory, ModelEntry
from services.router.prepare import Preparer
from services.router.scheduling import Candidate, WorkerId
from tests.waiting import eventually_async

SCALED = ModelEntry("tiny", "1", 2048, True, autoscaled=True)
FIXED = ModelEntry("fixed", "1", 2048, False)
WORKER = Candidate(WorkerId("worker-0"), "127.0.0.1:1", "tiny", "1", 2048)
GOLD = Principal("acme", "gold", "k1", "salt")


@pytest.fixture
async def setup(redis, monkeypatch):
    monkeypatch.setattr(prepare, "SCALE_UP_POLL_S", 0.02)
    await redis.delete(DEMAND_KEY.format("tiny"))
    workers: list[Candidate] = []

    async def fetch():
        return [SCALED, FIXED], list(workers)

    directory = MeshDirectory(fetch, refresh_seconds=0.01)
    timeouts = {"gold": 2.0}
    awaiting = Gauge("awaiting", "test", ["model"], registry=CollectorRegistry())
    p = Preparer(directory, scheduler=None, tokenizer_for=None, kv=None, demand=Demand(redis, awaiting=awaiting),
                 queue_timeout=lambda tier: timeouts[tier])
    p.awaiting = awaiting
    return p, workers, timeouts


async def test_a_request_for_a_pool_at_zero_waits_marks_demand_and_goes_on_when_a_worker_serves(setup, redis):
    p, workers, _ = setup
    waiting = asyncio.create_task(p.serving(SCALED, GOLD))

    async def demand_marked() -> bool:
        return await redis.pttl(DEMAND_KEY.format("tiny")) > 0

    await eventually_async(demand_marked, 5, every=0.01, what="the autoscaler told of the demand, with a TTL")
    assert not waiting.done(), "it waits for a worker"
    assert p.awaiting.labels("tiny")._value.get() == 1, "counted for KEDA while it waits"
    workers.append(WORKER)
    got = await asyncio.wait_for(waiting, 2)
    assert [w.worker_id for w in got] == ["worker-0"]
    assert p.awaiting.labels("tiny")._value.get() == 0


async def test_past_its_tiers_queue_timeout_it_is_told_to_retry_later(setup):
    p, _, timeouts = setup
    timeouts["gold"] = 0.1
    with pytest.raises(errors.Unavailable, match="gold tier's queue timeout") as err:
        await p.serving(SCALED, GOLD)
    assert err.value.retry_after == 5.0


async def test_a_model_that_is_not_autoscaled_is_refused_at_once(setup, redis):
    p, _, _ = setup
    with pytest.raises(errors.Unavailable, match="'fixed' is deployed with no workers"):
        await asyncio.wait_for(p.serving(FIXED, GOLD), 0.5)
    assert not await redis.exists(DEMAND_KEY.format("fixed"))


async def test_while_the_ingress_waits_on_a_decision_it_is_passed_on_at_once_having_told_the_autoscaler(setup, redis):
    """The direct path: the ingress is not held on the router's decision while a worker starts
    (the request goes on to the router's own route and waits there)."""
    p, _, _ = setup
    with pytest.raises(prepare.ScalingUp):
        await asyncio.wait_for(p.serving(SCALED, GOLD, for_ingress=True), 0.5)
    assert await redis.exists(DEMAND_KEY.format("tiny"))
