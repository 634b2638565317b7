"""The router's metering against a real Redis: budgets checked atomically (concurrent requests
cannot race past one), one usage event per request appended before its last chunk is released,
requests cut short metered for what they produced, and events spooled to disk while Redis is away."""

import asyncio
import itertools
import time

import pytest
from redis.asyncio import Redis

from gaas.contracts import errors, pricing, usage as metering
from gaas.metering import admission
from gaas.runtime import redisconn
from gaas.v1 import common_pb2
from gaas.contracts.principal import Principal
from gaas.metering.local import LocalQuotas
from gaas.metering.meter import Meter
from gaas.metering.meter import metered
from tests.waiting import eventually_async

PRICE = pricing.Price(input=1.0, cached_input=0.1, output=2.0)  # micro-dollars per token
_ids = itertools.count()


def principal(tenant: str) -> Principal:
    return Principal(tenant=tenant, tier="gold", key_id="key_t", cache_salt="salt")


def fresh_tenant() -> str:
    return f"t{next(_ids)}-{time.monotonic_ns()}"


@pytest.fixture
def meter(redis, tmp_path):
    return Meter(redis, tmp_path / "spool")


async def admit(meter: Meter, tenant: str, rid: str, prompt=10, max_tokens=20, parts=1):
    return await meter.admit(principal(tenant), rid, "m", "1", PRICE, prompt, max_tokens, parts, "client-1",
                             time.perf_counter())


def chunk(tokens: int, usage: tuple[int, int, int] | None = None, worker="worker-0") -> common_pb2.GenerateChunk:
    c = common_pb2.GenerateChunk(token_ids=list(range(tokens)), text="x" * tokens)
    if usage:
        c.usage.prompt_tokens, c.usage.cached_tokens, c.usage.completion_tokens = usage
        c.worker_id = worker
    return c


async def stream_events(redis: Redis, request_id: str) -> list[metering.UsageEvent]:
    entries = await redis.xrange(metering.STREAM)
    events = [metering.UsageEvent.from_fields(f) for _, f in entries]
    return [e for e in events if e.request_id == request_id]


async def test_concurrent_requests_cannot_race_past_a_budget(meter, redis):
    tenant = fresh_tenant()
    estimate = pricing.estimate_micros(PRICE, 10, 20)
    await redis.set(admission.budget_key(tenant), 5 * estimate + estimate // 2)  # room for five, not six

    async def one(i):
        try:
            return await admit(meter, tenant, f"{tenant}-r{i}")
        except errors.ResourceExhausted:
            return None

    results = await asyncio.gather(*(one(i) for i in range(40)))
    assert sum(r is not None for r in results) == 5


async def test_a_refusal_names_the_budget_and_when_to_retry(meter, redis):
    tenant = fresh_tenant()
    await redis.set(admission.budget_key(tenant), 12_500_000)
    await redis.set(admission.spend_key(tenant, metering.month_of(metering.now_ms())), 12_499_999)
    with pytest.raises(errors.ResourceExhausted) as info:
        await admit(meter, tenant, "r")
    err = info.value
    assert err.reason == "insufficient_quota" and err.retry_after >= 1
    assert f"tenant {tenant} has used its monthly budget of $12.50" in err.message
    assert "raised or the month turns" in err.message


async def test_a_finished_request_turns_its_reservation_into_spend(meter, redis):
    tenant = fresh_tenant()
    await redis.set(admission.budget_key(tenant), 10**9)
    m = await admit(meter, tenant, f"{tenant}-r")
    assert await redis.hlen(admission.inflight_key(tenant)) == 1
    chunks = [chunk(3), chunk(2, usage=(10, 4, 5))]
    got = [c async for c in metered(meter, m, _agen(chunks))]
    assert got == chunks
    assert await redis.hlen(admission.inflight_key(tenant)) == 0
    spend = int(await redis.get(admission.spend_key(tenant, metering.month_of(metering.now_ms()))))
    assert spend == pricing.cost_micros(PRICE, 10, 4, 5) == 6 + 0 + 10  # 0.4 rounds to 0
    [e] = await stream_events(redis, f"{tenant}-r")
    assert (e.prompt_tokens, e.cached_tokens, e.completion_tokens, e.outcome) == (10, 4, 5, "finished")
    assert (e.tenant, e.key_id, e.model, e.worker, e.client_request_id) == (tenant, "key_t", "m", "worker-0", "client-1")


async def test_the_event_is_in_the_stream_before_the_last_chunk_is_released(meter, redis):
    tenant = fresh_tenant()
    m = await admit(meter, tenant, f"{tenant}-r")
    seen_before_last = None
    async for c in metered(meter, m, _agen([chunk(1), chunk(4, usage=(7, 0, 5))])):
        if c.HasField("usage"):  # the last chunk carries text and usage alike: both counted
            seen_before_last = await stream_events(redis, f"{tenant}-r")
    assert [e.completion_tokens for e in seen_before_last] == [5]


async def test_a_batch_is_one_event_once_every_prompt_has_its_usage(meter, redis):
    tenant = fresh_tenant()
    m = await admit(meter, tenant, f"{tenant}-r", parts=2)
    async for _ in metered(meter, m, _agen([chunk(2, usage=(5, 0, 2)), chunk(3, usage=(6, 2, 3))])):
        pass
    [e] = await stream_events(redis, f"{tenant}-r")
    assert (e.prompt_tokens, e.cached_tokens, e.completion_tokens) == (11, 2, 5)


async def test_a_client_that_goes_away_is_billed_for_what_it_received(meter, redis):
    tenant = fresh_tenant()
    m = await admit(meter, tenant, f"{tenant}-r", prompt=9)
    gen = metered(meter, m, _agen([chunk(2), chunk(3), chunk(4), chunk(1, usage=(9, 0, 10))]))
    await gen.__anext__()
    await gen.__anext__()
    await gen.aclose()  # the client hung up after two chunks
    await meter.close()
    [e] = await stream_events(redis, f"{tenant}-r")
    assert (e.prompt_tokens, e.completion_tokens, e.outcome) == (9, 5, "cancelled")


async def test_a_request_that_produced_nothing_releases_its_reservation(meter, redis):
    tenant = fresh_tenant()
    await redis.set(admission.budget_key(tenant), 10**9)
    m = await admit(meter, tenant, f"{tenant}-r")

    async def failing():
        raise errors.Unavailable("no worker")
        yield  # pragma: no cover

    with pytest.raises(errors.Unavailable):
        async for _ in metered(meter, m, failing()):
            pass
    await meter.close()
    assert await redis.hlen(admission.inflight_key(tenant)) == 0
    assert await stream_events(redis, f"{tenant}-r") == []


async def test_a_reservation_of_a_router_that_died_lapses(meter, redis):
    tenant = fresh_tenant()
    estimate = pricing.estimate_micros(PRICE, 10, 20)
    await redis.set(admission.budget_key(tenant), estimate)
    now = metering.now_ms()
    await redis.hset(admission.inflight_key(tenant), "dead-router-request", estimate)
    await redis.zadd(admission.inflight_exp_key(tenant), {"dead-router-request": now - 1})
    assert await admit(meter, tenant, f"{tenant}-r") is not None


async def test_usage_waits_in_the_spool_while_redis_is_away_and_is_appended_after(redis, tmp_path):
    down = redisconn.connect("redis://127.0.0.1:1/0", timeout=0.2)  # nothing listens there
    meter = Meter(down, tmp_path / "spool", local=LocalQuotas())
    tenant = fresh_tenant()
    m = await admit(meter, tenant, f"{tenant}-r")  # Redis cannot count: the router's own count admits it
    async for _ in metered(meter, m, _agen([chunk(2, usage=(3, 0, 2))])):
        pass
    assert meter.spooled == 1 and await meter.drain_spool() == 0
    await down.aclose()
    meter._record._redis = redis  # Redis is back (as if reconnected)
    assert await meter.drain_spool() == 1
    assert [e.completion_tokens for e in await stream_events(redis, f"{tenant}-r")] == [2]
    assert not (tmp_path / "spool" / "usage.spool").exists()


async def _agen(items):
    for item in items:
        yield item


async def test_a_request_retried_on_another_worker_before_its_first_token_is_one_event(meter, redis):
    import grpc

    from tests.unit.router.support import OK, collect, rpc_error, serve

    rt, fake = await serve({"w0": [rpc_error(grpc.StatusCode.UNAVAILABLE)], "w1": OK}, meter=meter)
    try:
        await collect(rt, prompt="hi", request_id="retried")
    finally:
        await rt.shutdown()
    assert len(fake.calls) == 2
    entries = [metering.UsageEvent.from_fields(f) for _, f in await redis.xrange(metering.STREAM)]
    events = [e for e in entries if e.client_request_id == "retried"]
    assert [(e.tenant, e.completion_tokens, e.outcome) for e in events] == [("acme", 2, "finished")]


async def test_a_request_that_fails_after_tokens_is_billed_for_them_as_failed(meter, redis):
    import grpc

    from tests.unit.router.support import chunk as worker_chunk, collect, rpc_error, serve

    died = [worker_chunk("a"), worker_chunk("b"), rpc_error(grpc.StatusCode.UNAVAILABLE, "engine died")]
    rt, _ = await serve({"w0": died, "w1": died}, meter=meter)
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(rt, prompt="hi", request_id="client-id")
    finally:
        await rt.shutdown()
    await meter.close()
    entries = [metering.UsageEvent.from_fields(f) for _, f in await redis.xrange(metering.STREAM)]
    [e] = [e for e in entries if e.client_request_id == "client-id" and e.tenant == "acme"]
    assert (e.completion_tokens, e.outcome) == (2, "failed") and e.prompt_tokens == 3  # "hi" + BOS


async def test_last_months_spend_does_not_count_against_this_months_budget(meter, redis):
    tenant = fresh_tenant()
    await redis.set(admission.budget_key(tenant), 1_000_000)
    await redis.set(admission.spend_key(tenant, "202001"), 999_999_999)
    assert await admit(meter, tenant, f"{tenant}-r") is not None


async def test_a_redis_that_forgot_the_scripts_still_takes_the_events(meter, redis):
    await redis.script_flush()  # as after a restart
    tenant = fresh_tenant()
    m = await admit(meter, tenant, f"{tenant}-r")
    async for _ in metered(meter, m, _agen([chunk(2, usage=(3, 0, 2))])):
        pass
    assert [e.completion_tokens for e in await stream_events(redis, f"{tenant}-r")] == [2]
    assert meter.spooled == 0


@pytest.mark.parametrize("hang_up_after_s", [0.0, 0.1])
async def test_a_client_that_hangs_up_before_its_first_token_is_billed_for_the_prompt_the_engine_computed(
        meter, redis, hang_up_after_s):
    """The request reached a worker, whose engine may be computing its prompt: the worker's call
    runs on to its first chunk (not cancelled with the client) and the prompt, as cached as the
    engine said, and that chunk's token are billed, whatever the client did."""
    import asyncio

    import grpc

    from gaas.v1 import inference_pb2, inference_pb2_grpc
    from tests.unit.router.support import AUTH, serve
    from tests.unit.router.support import chunk as worker_chunk

    async def prefilled():
        await asyncio.sleep(0.4)  # the engine computes the prompt
        c = worker_chunk("a")
        c.prefill.prompt_tokens, c.prefill.cached_tokens = 9, 4
        return c

    rt, fake = await serve({"w0": [prefilled, worker_chunk("b", final=True)]}, workers=("w0",), meter=meter)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            call = inference_pb2_grpc.InferenceStub(ch).Generate(
                inference_pb2.GenerateRequest(prompt="hi there", request_id=f"hung-up-{hang_up_after_s}"), timeout=5,
                metadata=AUTH)
            await asyncio.sleep(0.15 + hang_up_after_s)  # placed, sent to the worker, no token yet
            call.cancel()
        await asyncio.sleep(0.1)
        assert fake.made and not fake.made[0].cancelled, "the worker's call was cut with the client"
        await eventually_async(lambda: fake.made[0].cancelled, 5, every=0.02,
                               what="the worker's call ended once its first chunk came")
        await meter.close()

        async def billed() -> list:
            return [e for e in (metering.UsageEvent.from_fields(f) for _, f in await redis.xrange(metering.STREAM))
                    if e.client_request_id == f"hung-up-{hang_up_after_s}"]

        events = await eventually_async(billed, 5, every=0.05, what="a usage event for the prefilled prompt")
    finally:
        await rt.shutdown()
    assert len(events) == 1, events
    [e] = events
    assert (e.prompt_tokens, e.cached_tokens, e.completion_tokens, e.outcome) == (9, 4, 1, "cancelled")


# ------------------------------------------------------------------ the direct path: billed once, whoever records


async def direct_request(router: Meter, tenant: str, rid: str, prompt=10):
    return await router.admit(principal(tenant), rid, "m", "1", PRICE, prompt, 20, 1, "client-1", time.perf_counter(),
                              direct=True)


def worker_record(redis, tmp_path, m):
    """The worker's own record of the same request (it meters what it streams)."""
    from gaas.metering import direct as direct_contract
    from gaas.v1 import worker_pb2

    d = worker_pb2.DirectGenerate(request_id=m.request_id)
    d.prompts.add(request_id=m.request_id)
    mm = d.metering
    mm.tenant, mm.tier, mm.key_id, mm.model, mm.model_version, mm.prompt_tokens = (m.principal.tenant, "gold", "key_t",
                                                                                     "m", "1", m.prompt_tokens)
    mm.price_input, mm.price_cached_input, mm.price_output, mm.admitted = PRICE.input, PRICE.cached_input, \
        PRICE.output, True
    return Meter(redis, tmp_path / "worker-spool", streams_direct=True), direct_contract.metered(d, time.perf_counter())


async def test_a_direct_request_the_worker_billed_is_not_billed_again_by_the_router(meter, redis, tmp_path):
    tenant = fresh_tenant()
    m = await direct_request(meter, tenant, f"{tenant}-r")
    assert await redis.get(admission.progress_key(tenant, m.request_id)) == "0 0"
    worker, w = worker_record(redis, tmp_path, m)
    async for _ in metered(worker, w, _agen([chunk(2), chunk(3, usage=(10, 0, 5))])):
        pass
    await meter.claim(m)  # the router heard nothing (its report was lost): what the worker did stands
    [e] = await stream_events(redis, m.request_id)
    assert (e.completion_tokens, e.outcome) == (5, "finished")
    assert await redis.hlen(admission.inflight_key(tenant)) == 0


async def test_a_direct_request_whose_worker_died_is_billed_by_the_router_from_its_last_progress(meter, redis,
                                                                                               tmp_path):
    tenant = fresh_tenant()
    await redis.set(admission.budget_key(tenant), 10**9)
    m = await direct_request(meter, tenant, f"{tenant}-r", prompt=9)
    worker, w = worker_record(redis, tmp_path, m)
    gen = metered(worker, w, _agen([chunk(2), chunk(3), chunk(4), chunk(1, usage=(9, 0, 10))]))
    await gen.__anext__()
    await gen.__anext__()
    await worker.write_progress([w], "w0")  # then the worker dies: its record never made
    await meter.claim(m)
    [e] = await stream_events(redis, m.request_id)
    assert (e.prompt_tokens, e.completion_tokens, e.outcome) == (9, 5, "failed")
    assert admission.is_billed(await redis.get(admission.progress_key(tenant, m.request_id)))
    assert await redis.hlen(admission.inflight_key(tenant)) == 0
    spend = int(await redis.get(admission.spend_key(tenant, metering.month_of(metering.now_ms()))))
    # A worker that was only slow, recording after the router did (a spool replayed), changes nothing.
    await worker.write_progress([w], "w0")
    assert admission.is_billed(await redis.get(admission.progress_key(tenant, m.request_id)))
    await worker.commit(w, "cancelled")
    assert len(await stream_events(redis, m.request_id)) == 1
    assert int(await redis.get(admission.spend_key(tenant, metering.month_of(metering.now_ms())))) == spend


async def test_a_direct_request_served_whole_by_the_second_choice_after_the_first_billed_its_start_bills_the_rest(
        meter, redis, tmp_path):
    # The first choice took it and made a token, its sidecar died before passing anything on, and
    # the ingress sent the request to the second choice, which streamed the whole answer.
    tenant = fresh_tenant()
    m = await direct_request(meter, tenant, f"{tenant}-r", prompt=9)
    first, w1 = worker_record(redis, tmp_path, m)
    second, w2 = worker_record(redis, tmp_path / "second", m)
    async for _ in metered(first, w1, _agen([chunk(1, usage=(9, 0, 1))])):
        pass
    await first.commit(w1, "cancelled")
    async for _ in metered(second, w2, _agen([chunk(2), chunk(4, usage=(9, 0, 6), worker="worker-1")])):
        pass
    spend = int(await redis.get(admission.spend_key(tenant, metering.month_of(metering.now_ms()))))
    [e] = await stream_events(redis, m.request_id)
    [more] = await stream_events(redis, f"{m.request_id}{admission.SUPPLEMENT_MARK}6")
    # The prompt once, every token the client was sent, and the cost of both.
    assert (e.prompt_tokens + more.prompt_tokens, e.completion_tokens + more.completion_tokens) == (9, 6)
    assert more.outcome == metering.SUPPLEMENT and more.cost_input_micros == 0
    assert e.cost_micros + more.cost_micros == spend == pricing.cost_micros(PRICE, 9, 0, 6)
    # Either record again (a spool replayed) bills nothing more.
    await second._append(w2.event("finished"), "own")
    await first._append(w1.event("cancelled"), "own")
    assert int(await redis.get(admission.spend_key(tenant, metering.month_of(metering.now_ms())))) == spend


def test_a_supplement_bills_only_output_beyond_what_was_billed():
    event = metering.UsageEvent("r", "t", "k", "gold", "m", "1", 9, 3, 6, 60, 3, 600, "finished", "w1", 1)
    assert admission.supplement(event, "billed 6 600") is None
    assert admission.supplement(event, "billed") is None  # (written before values said what was billed)
    more = admission.supplement(event, "billed 1 100")
    assert (more.request_id, more.prompt_tokens, more.cached_tokens, more.completion_tokens, more.cost_micros) == (
        "r+6", 0, 0, 5, 500)
    assert admission.billed_value(more, "billed 1 100") == "billed 6 600"


async def test_a_direct_request_no_worker_took_gives_its_reservation_back(meter, redis):
    tenant = fresh_tenant()
    m = await direct_request(meter, tenant, f"{tenant}-r")
    await meter.claim(m)
    assert await stream_events(redis, m.request_id) == []
    assert await redis.hlen(admission.inflight_key(tenant)) == 0


async def test_a_direct_request_a_worker_took_and_died_before_its_first_token_is_billed_its_prompt(meter, redis,
                                                                                                   tmp_path):
    tenant = fresh_tenant()
    await redis.set(admission.budget_key(tenant), 10**9)
    m = await direct_request(meter, tenant, f"{tenant}-r", prompt=9)
    worker, w = worker_record(redis, tmp_path, m)
    await worker.write_progress([w], "w0")  # it took it; then it dies before any token went out
    await meter.claim(m)
    [e] = await stream_events(redis, m.request_id)
    assert (e.prompt_tokens, e.completion_tokens, e.outcome) == (9, 0, "failed")
    assert await redis.hlen(admission.inflight_key(tenant)) == 0
