"""Flow control in the router: tier bands end to end, the wait queue (band order, fairness between
tenants within a band, deadlines, shedding the lowest band first), the batching window's
controller, and the circuit breaker's state machine."""

import asyncio
import time
from dataclasses import replace

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gaas.contracts import errors, qos
from gaas.v1 import common_pb2
from services.router.breakers import CLOSED, HALF_OPEN, OPEN, Breakers
from services.router.flow import Flow, FlowSettings
from services.router.scheduling import Candidate, RequestContext, WorkerId, make_scheduler
from services.router.waitqueue import WaitQueue
from services.router.windows import Windows
from tests.fakeclock import FakeClock
from tests.waiting import eventually_async


# ------------------------------------------------------------------ bands


PRIORITIES = [common_pb2.PRIORITY_HIGH, common_pb2.PRIORITY_NORMAL, common_pb2.PRIORITY_LOW,
              common_pb2.PRIORITY_UNSPECIFIED]


@given(st.sampled_from(qos.BAND_NAMES), st.sampled_from(qos.BAND_NAMES), st.sampled_from(PRIORITIES),
       st.sampled_from(PRIORITIES))
def test_no_client_priority_lifts_a_request_above_a_better_tier(tier_a, tier_b, prio_a, prio_b):
    a, b = qos.engine_priority(tier_a, prio_a), qos.engine_priority(tier_b, prio_b)
    if qos.band(tier_a) < qos.band(tier_b):
        assert a < b, "a better tier is always served first, whatever either client asked"


def test_a_bronze_client_asking_for_high_priority_gets_bronzes_band():
    assert qos.engine_priority("bronze", common_pb2.PRIORITY_HIGH) > qos.engine_priority("silver", common_pb2.PRIORITY_LOW)
    assert qos.engine_priority("gold", common_pb2.PRIORITY_LOW) < qos.engine_priority("silver", common_pb2.PRIORITY_HIGH)
    # Within its band a client may lower (or raise) its own requests.
    assert (qos.engine_priority("silver", common_pb2.PRIORITY_HIGH) < qos.engine_priority("silver", 0)
            < qos.engine_priority("silver", common_pb2.PRIORITY_LOW))


# ------------------------------------------------------------------ the wait queue


class Room:
    """A pool of n slots: place() takes one, or says there is none."""

    def __init__(self, n: int = 0) -> None:
        self.free = n
        self.order: list[str] = []

    def placer(self, name: str):
        def place():
            if self.free <= 0:
                return None
            self.free -= 1
            self.order.append(name)
            return name
        return place


async def queued(q: WaitQueue, room: Room, name: str, band: int, tenant: str, deadline: float = 1e12):
    def arrivals() -> int:
        return sum(s.queued + s.shed + s.admitted for s in q.stats)

    before = arrivals()
    task = asyncio.create_task(q.wait(band, tenant, "m", deadline, room.placer(name), "test", abandon=lambda r: None))
    await eventually_async(lambda: arrivals() > before, 5, every=0, what=f"{name} queued, shed or placed")
    return task


async def test_room_goes_to_the_best_band_first_then_in_arrival_order():
    q, room = WaitQueue(), Room()
    tasks = [await queued(q, room, n, b, n) for n, b in (("b1", 2), ("s1", 1), ("b2", 2), ("g1", 0), ("s2", 1))]
    room.free = 5
    q.dispatch()
    await asyncio.gather(*tasks)
    assert room.order == ["g1", "s1", "s2", "b1", "b2"]


async def test_tenants_of_a_band_take_turns():
    q, room = WaitQueue(), Room()
    tasks = [await queued(q, room, f"a{i}", 1, "acme") for i in range(4)]
    tasks += [await queued(q, room, f"b{i}", 1, "beta") for i in range(2)]
    tasks += [await queued(q, room, "c0", 1, "corp")]
    room.free = 7
    q.dispatch()
    await asyncio.gather(*tasks)
    assert room.order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


async def test_a_request_that_waits_past_its_deadline_gets_deadline_exceeded():
    q, room = WaitQueue(), Room()
    task = asyncio.create_task(q.wait(2, "t", "m", time.monotonic() + 0.05,
                                      room.placer("x"), "the bronze tier's queue timeout is 0.05 s",
                                      abandon=lambda r: None))
    with pytest.raises(errors.DeadlineExceeded, match="queue timeout"):
        await task
    assert len(q) == 0 and q.stats[2].timed_out == 1


async def test_a_full_queue_sheds_the_newest_of_the_lowest_band_never_a_better_one():
    q, room = WaitQueue(max_waiting=3), Room()
    bronze_old = await queued(q, room, "bronze-old", 2, "t1")
    bronze_new = await queued(q, room, "bronze-new", 2, "t2")
    silver = await queued(q, room, "silver", 1, "t3")
    gold = await queued(q, room, "gold", 0, "t4")  # full: the newest bronze goes
    with pytest.raises(errors.Unavailable, match="shed") as shed:
        await bronze_new
    assert shed.value.retry_after and shed.value.reason == "overloaded"
    with pytest.raises(errors.Unavailable):  # full of better bands: a bronze newcomer is refused
        await q.wait(2, "t5", "m", 1e12, room.placer("late"), "test", abandon=lambda r: None)
    room.free = 3
    q.dispatch()
    await asyncio.gather(gold, silver, bronze_old)
    assert room.order == ["gold", "silver", "bronze-old"]
    assert q.stats[2].shed == 2 and q.stats[0].shed == 0


async def test_a_caller_that_leaves_after_being_placed_gives_its_room_back():
    q, room = WaitQueue(), Room()
    given_back = []
    task = asyncio.create_task(q.wait(0, "t", "m", 1e12, room.placer("x"), "test", abandon=given_back.append))
    await eventually_async(lambda: len(q) == 1, 5, every=0, what="the caller queued")
    room.free = 1
    q.dispatch()  # placed...
    task.cancel()  # ...and the client hangs up before it runs
    with pytest.raises(asyncio.CancelledError):
        await task
    assert given_back == ["x"] and len(q) == 0


# ------------------------------------------------------------------ the window


def test_the_window_halves_when_a_tier_misses_its_target_and_grows_when_well_under():
    clock = FakeClock(1000.0)
    w = Windows({"gold": 100.0, "bronze": 1000.0}, initial=8, minimum=2, maximum=16, clock=clock)
    worker = WorkerId("w0")
    for _ in range(8):
        w.acquire(worker)  # full
    for _ in range(10):
        clock.advance(0.2)
        w.observe(worker, "gold", 30.0)
    assert w.state()[worker].limit > 8, "well under target while full: grows"
    grown = w.state()[worker].limit
    for _ in range(10):
        clock.advance(0.2)
        w.observe(worker, "gold", 150.0)  # gold's p95 past its 100 ms
    assert w.state()[worker].limit <= grown / 2
    for _ in range(40):
        clock.advance(0.5)
        w.observe(worker, "gold", 500.0)
    assert w.state()[worker].limit == 2, "never below the floor"


def test_a_flood_of_fast_bronze_does_not_grow_the_window_past_what_a_quiet_gold_has_shown():
    """Gold at 2 requests/s beside bronze at 30/s: bronze's first tokens, fast, come by the dozen after
    each change, gold's by two. Growing waits until gold too has shown its p95 since the change."""
    clock = FakeClock(1000.0)
    w = Windows({"gold": 100.0, "bronze": 1000.0}, initial=8, minimum=2, maximum=64, clock=clock)
    worker = WorkerId("w0")
    for _ in range(8):
        w.acquire(worker)
    for i in range(300):  # 10 s
        clock.advance(1 / 30)
        w.room([worker], qos.band("bronze"))  # bronze keeps finding it full
        w.observe(worker, "bronze", 50.0)
        if i % 15 == 0:
            w.observe(worker, "gold", 85.0)  # within its target, not well under it
    assert w.state()[worker].limit == 8 and w.state()[worker].grows == 0
    # Gold well under its target over the last 10 s: now it may grow.
    for i in range(330):
        clock.advance(1 / 30)
        w.room([worker], qos.band("bronze"))
        w.observe(worker, "bronze", 50.0)
        if i % 15 == 0:
            w.observe(worker, "gold", 20.0)
    assert w.state()[worker].grows >= 1


def test_a_window_that_turns_gold_away_grows_while_every_tier_meets_its_target():
    """Not well under target (no ordinary growth), but gold is waiting in the router: make room."""
    clock = FakeClock(1000.0)
    w = Windows({"gold": 100.0}, initial=4, minimum=2, maximum=16, clock=clock)
    worker = WorkerId("w0")
    for _ in range(10):
        clock.advance(0.2)
        while w.room([worker], qos.band("gold"))[worker]:  # gold takes every place, and one more is turned away
            w.acquire(worker)
        w.observe(worker, "gold", 90.0)
    assert w.state()[worker].limit > 4 and w.state()[worker].shrinks == 0
    # Past the target, gold waiting or not: the batch is what makes it late, so it shrinks.
    grown = w.state()[worker].limit
    for _ in range(20):
        clock.advance(0.2)
        w.room([worker], qos.band("gold"))
        w.observe(worker, "gold", 150.0)
    assert w.state()[worker].limit < grown and w.state()[worker].shrinks >= 1


def test_bronze_fills_half_a_window_silver_three_quarters_and_gold_goes_past_it():
    w = Windows({"gold": 100.0}, initial=8)
    worker = WorkerId("w0")
    for _ in range(4):
        w.acquire(worker)
    assert w.room([worker], qos.band("bronze")) == {worker: 0}
    assert w.room([worker], qos.band("silver")) == {worker: 2}
    assert w.room([worker], qos.band("gold")) == {worker: 12}  # to twice the window


def test_batch_requests_fill_what_the_tiers_leave_of_half_a_window_and_never_take_theirs():
    w = Windows({"gold": 100.0}, initial=8)
    worker = WorkerId("w0")
    assert w.room([worker], qos.band(qos.BATCH)) == {worker: 4}  # an idle worker: half its window
    for _ in range(4):
        w.acquire(worker, batch=True)
    assert w.room([worker], qos.band(qos.BATCH)) == {worker: 0}
    # The tiers do not count them: a bronze request has its whole share still.
    assert w.room([worker], qos.band("bronze")) == {worker: 4}
    w.acquire(worker)
    w.release(worker, batch=True)
    assert w.room([worker], qos.band(qos.BATCH)) == {worker: 0}  # the tiers' request counts for the batch band
    assert w.state()[worker].batch_in_flight == 3 and not w.state()[worker].full


# ------------------------------------------------------------------ the breaker


def test_the_breakers_state_machine():
    clock = FakeClock(1000.0)
    changes = []
    b = Breakers(clock=clock, on_change=lambda w, s, why: changes.append(s))
    w = WorkerId("w0")
    for _ in range(4):
        b.failure(w, "INTERNAL")
    assert w not in b.blocked(), "four failures are not yet a burst"
    b.failure(w, "INTERNAL")
    assert w in b.blocked() and b.state()[w].state == OPEN
    clock.advance(5.1)
    assert w not in b.blocked(), "after the cooldown one probe may go"
    b.started(w)
    assert b.state()[w].state == HALF_OPEN and w in b.blocked(), "only one probe at a time"
    b.failure(w, "INTERNAL")
    assert b.state()[w].state == OPEN and b.state()[w].cooldown == 10.0, "a failed probe doubles the cooldown"
    clock.advance(10.1)
    b.started(w)
    b.success(w, 20.0)
    assert b.state()[w].state == CLOSED and w not in b.blocked()
    assert changes == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]


def test_successes_between_failures_keep_the_breaker_closed():
    b = Breakers(clock=FakeClock(1000.0))
    w = WorkerId("w0")
    for _ in range(20):
        b.failure(w, "x")
        b.success(w)
    assert b.state()[w].state == CLOSED


def test_an_unreachable_worker_opens_at_once():
    b = Breakers(clock=FakeClock(1000.0))
    b.failure(WorkerId("w0"), "connect failed", immediate=True)
    assert WorkerId("w0") in b.blocked()


def test_the_slowness_threshold_follows_the_workers_own_p99_within_bounds():
    clock = FakeClock(1000.0)
    b = Breakers(clock=clock)
    w = WorkerId("w0")
    assert b.threshold_ms(w) == 12_000, "no history yet: the ceiling"
    for i in range(100):
        b.success(w, 100.0 + i * 10)  # p99 about 1080 ms
    assert b.threshold_ms(w) == pytest.approx(1.3 * 1080, rel=0.02)
    fast = Breakers(clock=clock)
    for _ in range(50):
        fast.success(w, 5.0)
    assert fast.threshold_ms(w) == 800, "never below the floor"


def test_a_burst_of_long_prompts_is_slow_without_opening_the_breaker_and_a_slow_short_one_still_fails():
    """A first token's time grows with the prompt the engine computes: thresholds are kept per unit
    of work and scaled by the request's own (breakers.prompt_work)."""
    from services.router.breakers import WORK_TOKENS, prompt_work

    clock = FakeClock(1000.0)
    b = Breakers(clock=clock)
    w = WorkerId("w0")
    for _ in range(50):
        b.success(w, 40.0, prompt_work(100))  # short prompts: ~40 ms
    assert b.threshold_ms(w) == 800
    long = prompt_work(16 * WORK_TOKENS)  # a 16K-token prompt: 17 units
    assert b.threshold_ms(w, long) >= 17 * 800 * 0.9, "its ceiling and floor scale with it"
    # Its first token in 2 s is in line with the short ones' pace: within the threshold.
    assert 2_000 < b.threshold_ms(w, long)
    for _ in range(30):  # a burst of them, each as fast as its length allows, keeps the breaker closed
        b.success(w, 2_000, long)
    assert b.state()[w].state == "closed" and b.threshold_ms(w) == 800, "nor moves a short prompt's threshold"
    # A short prompt that takes as long is slow for its length.
    assert b.threshold_ms(w, prompt_work(100)) < 2_000


# ------------------------------------------------------------------ flow: placing through the scheduler


def cand(wid: str) -> Candidate:
    return Candidate(WorkerId(wid), f"addr-{wid}", "m", "1", 4096)


async def test_a_gold_request_gets_room_bronze_cannot_take():
    flow = Flow(qos.DEFAULT_POLICIES, FlowSettings(window_initial=4))
    s = make_scheduler("round_robin")
    workers = [cand("w0")]
    for _ in range(2):  # bronze fills its half of the window
        await flow.place(s, RequestContext(model="m"), workers, "bronze", "cheap", None)
    bronze = asyncio.create_task(flow.place(s, RequestContext(model="m"), workers, "bronze", "cheap", 5.0))
    await eventually_async(lambda: len(flow.queue) == 1 or bronze.done(), 5, every=0, what="bronze queued")
    assert not bronze.done() and len(flow.queue) == 1, "bronze waits"
    gold = await asyncio.wait_for(flow.place(s, RequestContext(model="m"), workers, "gold", "rich", 5.0), 1)
    assert gold.worker.worker_id == "w0"
    flow.finished(WorkerId("w0"))  # one ends: 2 in flight, still no room in bronze's half
    await asyncio.sleep(0)
    assert not bronze.done()
    flow.finished(WorkerId("w0"))  # another: the waiting bronze request gets its room
    assert (await asyncio.wait_for(bronze, 1)).worker.worker_id == "w0"


async def test_with_qos_off_nothing_waits_and_the_client_priority_stands():
    flow = Flow(qos.DEFAULT_POLICIES, FlowSettings(enabled=False, window_initial=1))
    s = make_scheduler("round_robin")
    for _ in range(10):
        await asyncio.wait_for(flow.place(s, RequestContext(model="m"), [cand("w0")], "bronze", "t", None), 1)
    assert flow.engine_priority("bronze", common_pb2.PRIORITY_HIGH) is None


def test_a_busy_worker_shrinks_its_window_and_a_failing_one_trips_its_breaker():
    flow = Flow(qos.DEFAULT_POLICIES, FlowSettings(window_initial=8))
    w = WorkerId("w0")
    flow.windows.acquire(w)
    flow.failed(w, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    assert flow.windows.state()[w].limit == 4 and w not in flow.breakers.blocked()
    flow.failed(w, grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert w in flow.breakers.blocked()


def test_a_probe_that_ends_without_a_verdict_lets_another_probe():
    clock = FakeClock(1000.0)
    b = Breakers(clock=clock)
    w = WorkerId("w0")
    b.failure(w, "UNAVAILABLE", immediate=True)
    clock.advance(5.1)
    b.started(w)
    assert w in b.blocked()
    b.ended(w)  # the probe's client went away: no success, no failure
    assert w not in b.blocked()


def test_a_worker_that_left_and_came_back_starts_with_a_closed_breaker_and_a_fresh_window():
    flow = Flow(qos.DEFAULT_POLICIES)
    w = WorkerId("w0")
    flow.breakers.failure(w, "UNAVAILABLE", immediate=True)
    flow.windows.shrink(w)
    flow.forget([])  # it left the registry
    assert w not in flow.breakers.blocked() and w not in flow.windows.state()


async def test_while_deciding_for_the_ingress_a_request_waits_at_most_the_decision_hold():
    """The direct path: the ingress's Envoy must not wait on a decision for long
    (services/router/holding.py), whatever the tier's queue timeout."""
    policies = {**qos.DEFAULT_POLICIES, "bronze": replace(qos.DEFAULT_POLICIES["bronze"], queue_timeout_s=600)}
    flow = Flow(policies, FlowSettings(window_initial=2))
    s = make_scheduler("round_robin")
    await flow.place(s, RequestContext(model="m"), [cand("w0")], "bronze", "t", None)  # bronze's half is full
    with pytest.raises(errors.DeadlineExceeded, match="the ingress waits on a decision at most 0.05 s"):
        await asyncio.wait_for(flow.place(s, RequestContext(model="m"), [cand("w0")], "bronze", "t", None,
                                          hold_s=0.05), 2)
