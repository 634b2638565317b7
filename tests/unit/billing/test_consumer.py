"""Usage events from the Redis Stream into the ledger against a real Redis: each request recorded
exactly once (replays, a consumer that died holding events, an entry that is not an event), and
only acknowledged once written."""

import asyncio
import itertools
import time

import pytest

from gaas.contracts import usage
from gaas.metering import admission
from gaas.contracts.usage import GROUP, STREAM, UsageEvent
from gaas.runtime import redisconn
from services.billing.budgets import Budgets
from services.billing.consumer import UsageConsumer
from tests.waiting import eventually_async

_ids = itertools.count()


def event(rid: str, tenant: str, completion=5) -> UsageEvent:
    return UsageEvent(rid, tenant, "key_1", "gold", "m", "1", 10, 4, completion, 6, 1, 2 * completion, "finished",
                      "worker-0", usage.now_ms())


@pytest.fixture
async def redis(redis_url):
    client = redisconn.connect(redis_url)
    await client.delete(STREAM)  # each test starts with no stream and no group
    yield client
    await client.aclose()


def tenant() -> str:
    return f"t{next(_ids)}-{time.monotonic_ns()}"


async def append(redis, *events: UsageEvent) -> None:
    for e in events:
        await redis.xadd(STREAM, e.to_fields())


async def drain(consumer: UsageConsumer) -> None:
    while await consumer.step(block_ms=50):
        pass


async def test_every_event_is_recorded_once_and_then_leaves_the_stream(redis, ledger):
    t = tenant()
    consumer = UsageConsumer(redis, ledger, "billing-0", batch=7, gather_s=0)
    await consumer.ensure_group()
    # A request spooled while Redis was away and appended twice is still one request.
    await append(redis, *(event(f"{t}-{i}", t) for i in range(30)), event(f"{t}-3", t))
    await drain(consumer)
    total = await ledger.totals(t)
    assert (total.requests, total.completion_tokens) == (30, 150)
    assert consumer.recorded == 30 and consumer.duplicates == 1
    assert await redis.xlen(STREAM) == 0
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 0


async def test_events_that_come_one_at_a_time_are_written_to_the_ledger_together(redis, ledger):
    t = tenant()
    writes = []
    record = ledger.record

    async def counted(events):
        writes.append(len(events))
        return await record(events)

    ledger.record = counted
    consumer = UsageConsumer(redis, ledger, "billing-0", gather_s=0.5)
    await consumer.ensure_group()
    assert await consumer.step(block_ms=10) == 0  # (nothing waiting from before)
    await append(redis, event(f"{t}-a", t))
    step = asyncio.create_task(consumer.step(block_ms=5000))
    await _until(lambda: redis.xpending(STREAM, GROUP), lambda p: p["pending"] == 1)  # the first read
    await append(redis, event(f"{t}-b", t))
    assert await step == 2 and writes == [2]
    assert (await ledger.totals(t)).requests == 2


async def test_events_a_dead_consumer_held_are_claimed_by_another(redis, ledger):
    t = tenant()
    await UsageConsumer(redis, ledger, "billing-0").ensure_group()
    await append(redis, *(event(f"{t}-{i}", t) for i in range(5)))
    # billing-0 reads them, then dies before writing the ledger.
    await redis.xreadgroup(GROUP, "billing-0", {STREAM: ">"}, count=100)
    other = UsageConsumer(redis, ledger, "billing-1", claim_idle_ms=0)  # (idle any time at all)
    assert await other.claim() == 5
    assert (await ledger.totals(t)).requests == 5
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 0


async def test_a_restarted_consumer_first_finishes_what_it_had_read(redis, ledger):
    t = tenant()
    await UsageConsumer(redis, ledger, "billing-0").ensure_group()
    await append(redis, *(event(f"{t}-{i}", t) for i in range(4)))
    await redis.xreadgroup(GROUP, "billing-0", {STREAM: ">"}, count=100)  # read, then killed
    again = UsageConsumer(redis, ledger, "billing-0")
    assert await again.step(block_ms=10) == 4
    assert (await ledger.totals(t)).requests == 4


async def test_an_entry_that_is_not_a_usage_event_is_kept_aside_and_does_not_block(redis, ledger):
    t = tenant()
    consumer = UsageConsumer(redis, ledger, "billing-0")
    await consumer.ensure_group()
    await redis.xadd(STREAM, {"request_id": "junk", "tenant": t})
    await append(redis, event(f"{t}-ok", t))
    await drain(consumer)
    assert (await ledger.totals(t)).requests == 1
    assert await ledger.dead_letters() == 1
    assert await redis.xlen(STREAM) == 0


async def test_the_consumer_recovers_when_redis_lost_its_group(redis, ledger):
    t = tenant()
    consumer = UsageConsumer(redis, ledger, "billing-0")
    task = asyncio.create_task(consumer.run(claim_every_seconds=3600))
    try:
        await append(redis, event(f"{t}-a", t))
        await _until(lambda: ledger.totals(t), lambda r: r.requests == 1)
        await redis.delete(STREAM)  # a Redis restarted without its data
        await append(redis, event(f"{t}-b", t))
        await _until(lambda: ledger.totals(t), lambda r: r.requests == 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_budgets_reach_redis_and_a_lost_spend_counter_is_rebuilt_from_the_ledger(redis, ledger):
    t = tenant()
    await ledger.record([event(f"{t}-{i}", t) for i in range(3)])
    budgets = Budgets(ledger, redis)
    await budgets.set(t, 5_000_000)
    month = usage.month_of(usage.now_ms())
    assert int(await redis.get(admission.budget_key(t))) == 5_000_000
    spent = (await ledger.totals(t)).cost_micros
    assert int(await redis.get(admission.spend_key(t, month))) == spent
    await redis.delete(admission.spend_key(t, month), admission.budget_key(t))  # Redis lost them
    await budgets.mirror()
    assert int(await redis.get(admission.spend_key(t, month))) == spent
    assert int(await redis.get(admission.budget_key(t))) == 5_000_000
    await budgets.set(t, 0)
    assert await redis.get(admission.budget_key(t)) is None


async def _until(read, ok, timeout=10.0):
    seen: list = []

    async def holds():
        seen[:] = [await read()]
        return ok(seen[0])

    await eventually_async(holds, timeout, every=0.05, what=lambda: f"the value to change (still {seen})")
    return seen[0]
