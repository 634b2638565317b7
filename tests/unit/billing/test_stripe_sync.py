"""Usage to Stripe through the outbox, with the official `stripe` SDK pointed at a local server
that follows Stripe's meter-event contract: each (tenant, meter, window) counted once whatever is
retried, Stripe down for an hour losing nothing, refusals kept visible, and events unconfirmed
past Stripe's dedupe window reconciled against the meter's summaries instead of resent blindly."""

import time

import pytest

from gaas.contracts.usage import UsageEvent
from services.billing.stripe_sync import KINDS, StripeMeterSender, StripeSync
from tests.fakeclock import FakeClock
from tests.stripefake import FakeStripe

METERS = {"input": "gaas_input_tokens", "cached_input": "gaas_cached_input_tokens", "output": "gaas_output_tokens"}
HOUR = 3_600_000


@pytest.fixture
def clock():
    """The sync's clock, started at the real time: the local Stripe, like Stripe, refuses meter events
    stamped too far from it."""
    return FakeClock(time.time())


@pytest.fixture
def stripe():
    fake = FakeStripe("sk_test_sync", meters=tuple(METERS.values())).start()
    yield fake
    fake.stop()


def sync_for(ledger, stripe, clock, customers=None, key="sk_test_sync") -> StripeSync:
    customers = {"acme": "cus_acme", "globex": "cus_globex"} if customers is None else customers

    async def lookup():
        return customers

    return StripeSync(ledger.db, StripeMeterSender(key, stripe.url), METERS, lookup, window_seconds=3600,
                      grace_seconds=60, rate_per_s=100, clock=clock)


def event(rid, tenant="acme", ago_ms=3 * HOUR, prompt=100, cached=40, completion=25) -> UsageEvent:
    return UsageEvent(rid, tenant, "key_1", "gold", "m", "1", prompt, cached, completion, 0, 0, 0, "finished",
                      "worker-0", int(time.time() * 1000) - ago_ms)


async def expected(ledger, tenant) -> dict[str, int]:
    t = await ledger.totals(tenant)
    return {"input": t.prompt_tokens - t.cached_tokens, "cached_input": t.cached_tokens, "output": t.completion_tokens}


def stripe_has(stripe, customer) -> dict[str, int]:
    totals = stripe.totals()
    return {kind: totals.get((customer, METERS[kind]), 0) for kind in KINDS}


async def test_closed_windows_reach_stripe_once_per_tenant_meter_and_window(ledger, stripe, clock):
    sync = sync_for(ledger, stripe, clock)
    await ledger.record([event("a1"), event("a2", ago_ms=2 * HOUR), event("g1", tenant="globex"),
                         event("n1", tenant="nocustomer"), event("open", ago_ms=1000)])
    await sync.collect()
    assert await sync.send_due() == 9  # acme: 2 windows x 3 meters; globex: 1 x 3; the open window waits
    assert await sync.collect() == 0 and await sync.send_due() == 0
    # A late event of a window already reported goes as a batch of its own; nothing counted twice.
    await ledger.record([event("late", ago_ms=3 * HOUR, prompt=7, cached=0, completion=1)])
    await sync.collect()
    await sync.send_due()
    open_window = await ledger.totals("acme", int(clock.now * 1000) - 60_000)
    want = await expected(ledger, "acme")
    want = {"input": want["input"] - 60, "cached_input": want["cached_input"] - 40, "output": want["output"] - 25}
    assert open_window.requests == 1 and stripe_has(stripe, "cus_acme") == want
    assert stripe_has(stripe, "cus_globex") == await expected(ledger, "globex")
    assert stripe.duplicates == 0


async def test_a_retry_after_a_lost_answer_is_not_counted_twice(ledger, stripe, clock):
    sync = sync_for(ledger, stripe, clock)
    await ledger.record([event("a1")])
    await sync.collect()
    stripe.lose_answers(1)  # Stripe takes the first event but the answer never arrives
    assert await sync.send_due() == 0
    clock.advance(5)
    assert await sync.send_due() == 3
    assert stripe.duplicates == 1
    assert stripe_has(stripe, "cus_acme") == await expected(ledger, "acme")


async def test_stripe_down_for_an_hour_loses_nothing_and_catches_up_after(ledger, stripe, clock):
    sync = sync_for(ledger, stripe, clock)
    await ledger.record([event(f"a{i}", ago_ms=(i % 5 + 2) * HOUR) for i in range(40)])
    await sync.collect()
    stripe.fail_for(3600, status=503)
    for _ in range(3600):  # an hour, a second at a time
        await sync.send_due()
        clock.advance(1)
    attempts_while_down = stripe.requests
    assert attempts_while_down < 40  # backed off, not hammering
    stripe.fail_for(0)
    for _ in range(40):
        await sync.send_due()
        clock.advance(300)
    assert stripe_has(stripe, "cus_acme") == await expected(ledger, "acme")
    counts = await sync.counts()
    assert (counts.pending, counts.sent, counts.failed) == (0, 15, 0)


async def test_rate_limits_are_respected_and_retried(ledger, stripe, clock):
    sync = sync_for(ledger, stripe, clock)
    await ledger.record([event("a1")])
    await sync.collect()
    stripe.fail_next(2, status=429)
    for _ in range(20):
        await sync.send_due()
        clock.advance(10)
    assert stripe_has(stripe, "cus_acme") == await expected(ledger, "acme")


async def test_an_event_stripe_refuses_is_kept_visible_as_failed(ledger, stripe, clock):
    stripe.meters = {METERS["input"], METERS["output"]}  # no cached-input meter configured at Stripe
    sync = sync_for(ledger, stripe, clock)
    await ledger.record([event("a1")])
    await sync.collect()
    assert await sync.send_due() == 2
    counts = await sync.counts("acme")
    assert (counts.sent, counts.failed) == (2, 1)
    assert "No active meter" in sync.last_error


async def test_a_wrong_key_is_retried_not_dropped(ledger, stripe, clock):
    sync = sync_for(ledger, stripe, clock, key="sk_test_wrong")
    await ledger.record([event("a1")])
    await sync.collect()
    assert await sync.send_due() == 0
    assert (await sync.counts()).pending == 3 and "AuthenticationError" in sync.last_error


async def test_windows_older_than_stripe_accepts_are_marked_expired(ledger, stripe, clock):
    sync = sync_for(ledger, stripe, clock)
    await ledger.record([event("old", ago_ms=36 * 24 * HOUR)])
    await sync.collect()
    assert await sync.send_due() == 0
    assert (await sync.counts()).expired == 3 and stripe.requests == 0


async def unconfirmed_for_a_day(sync, stripe, clock) -> None:
    """Send while every answer fails, until Stripe's dedupe window has passed."""
    stripe.fail_for(10**6)
    for _ in range(30):
        clock.advance(3600)
        await sync.send_due()
    stripe.fail_for(0)
    assert (await sync.counts()).reconcile == 3


async def test_an_event_stripe_took_but_never_confirmed_is_confirmed_by_the_summaries(ledger, stripe, clock):
    sync = sync_for(ledger, stripe, clock)
    await ledger.record([event("a1", ago_ms=2 * HOUR)])
    await sync.collect()
    stripe.lose_answers(3)  # Stripe takes all three; no answer arrives
    for _ in range(3):
        await sync.send_due()
        clock.advance(400)  # past the backoff
    assert len(stripe.events) == 3
    await unconfirmed_for_a_day(sync, stripe, clock)
    assert await sync.reconcile() == 3
    assert (await sync.counts()).sent == 3
    assert await sync.send_due() == 0
    assert stripe_has(stripe, "cus_acme") == await expected(ledger, "acme")


async def test_an_event_that_never_reached_stripe_is_sent_again_once_reconciled(ledger, stripe, clock):
    sync = sync_for(ledger, stripe, clock)
    await ledger.record([event("a1", ago_ms=2 * HOUR)])
    await sync.collect()
    await unconfirmed_for_a_day(sync, stripe, clock)
    assert await sync.reconcile() == 3
    assert await sync.send_due() == 3
    assert stripe_has(stripe, "cus_acme") == await expected(ledger, "acme")
    assert (await sync.counts()).sent == 3


async def test_without_a_key_syncing_is_off_and_the_status_says_why(ledger, redis_url):
    from gaas.runtime import redisconn
    from gaas.v1 import billing_pb2
    from services.billing.budgets import Budgets
    from services.billing.consumer import UsageConsumer
    from services.billing.servicer import BillingServicer

    async def no_customers(max_age=0):
        return {}

    redis = redisconn.connect(redis_url)
    sync = StripeSync(ledger.db, None, METERS, no_customers)
    servicer = BillingServicer(ledger, Budgets(ledger, redis), sync, UsageConsumer(redis, ledger, "b"), no_customers,
                               "no Stripe key: set GAAS_STRIPE_API_KEY to report usage to Stripe")
    await ledger.record([event("a1")])
    assert await sync.collect() == 0 and await sync.send_due() == 0
    status = await servicer.GetStatus(billing_pb2.GetBillingStatusRequest(), None)
    await redis.aclose()
    assert not status.stripe_enabled and "GAAS_STRIPE_API_KEY" in status.stripe_disabled_reason
    assert status.ledger_rows == 1
