"""Quotas in Redis, as every router replica enforces them: requests and tokens per minute over a
sliding minute, requests at once, tokens reserved at admission and settled from the usage event,
refusals with a QuotaFailure and when to retry; two routers sharing one quota admit exactly it."""

import asyncio
import itertools
import time

import pytest

from gaas.contracts import errors, pricing
from gaas.metering import admission
from gaas.contracts.qos import Limits
from gaas.runtime import redisconn
from gaas.v1 import common_pb2
from gaas.contracts.principal import Principal
from gaas.metering.local import LocalQuotas
from gaas.metering.meter import Meter
from gaas.metering.meter import metered
from tests.fakeclock import FakeClock

_ids = itertools.count()
T0 = 1_800_000_000  # a Unix moment (s) on a whole minute


def tenant() -> str:
    return f"q{next(_ids)}-{time.monotonic_ns()}"


def who(name: str, **limits) -> Principal:
    return Principal(name, "silver", "key_q", "salt", Limits(**limits))


async def admit(meter, p: Principal, prompt=10, max_tokens=10, sequences=1):
    """'ok' (and the request's handle), or the refusal."""
    rid = f"{p.tenant}-{next(_ids)}"
    try:
        return await meter.admit(p, rid, "m", "1", pricing.FREE, prompt, max_tokens, 1, "", time.perf_counter(),
                                 sequences=sequences)
    except errors.ResourceExhausted as exc:
        return exc


async def finish(meter, m, completion: int, prompt: int = 10) -> None:
    c = common_pb2.GenerateChunk(token_ids=list(range(completion)), worker_id="w")
    c.usage.prompt_tokens, c.usage.completion_tokens = prompt, completion

    async def one():
        yield c

    async for _ in metered(meter, m, one()):
        pass


@pytest.mark.parametrize("limits, requests, admitted, refused_by", [
    ({"rpm": 3}, 5, 3, "requests per minute: 3"),
    ({"concurrency": 2}, 4, 2, "concurrent sequences: 2"),
    ({"tpm": 100}, 5, 5, None),           # 20 tokens each: 100 fit exactly
    ({"tpm": 99}, 5, 4, "tokens per minute: 99"),
    ({"rpm": 10, "concurrency": 3}, 6, 3, "concurrent sequences: 3"),
    ({}, 50, 50, None),                   # 0: unlimited
])
async def test_quota_arithmetic(redis, tmp_path, limits, requests, admitted, refused_by):
    meter = Meter(redis, tmp_path, clock=FakeClock(T0).millis)
    p = who(tenant(), **limits)
    results = [await admit(meter, p) for _ in range(requests)]
    refusals = [r for r in results if isinstance(r, errors.ResourceExhausted)]
    assert requests - len(refusals) == admitted
    if refused_by:
        assert {r.quota.description for r in refusals} == {refused_by}
        assert all(r.quota.subject == f"tenant:{p.tenant}" and r.reason == "rate_limit_exceeded" for r in refusals)
        assert all(r.retry_after >= 1 for r in refusals)


async def test_the_minute_slides_and_says_when_to_come_back(redis, tmp_path):
    clock = FakeClock(T0)
    meter = Meter(redis, tmp_path, clock=clock.millis)
    p = who(tenant(), rpm=2)
    assert not isinstance(await admit(meter, p), Exception)
    clock.advance(30)
    assert not isinstance(await admit(meter, p), Exception)
    clock.advance(10)
    refused = await admit(meter, p)
    assert isinstance(refused, errors.ResourceExhausted) and refused.retry_after == pytest.approx(20, abs=1)
    assert "made 2 requests in the last minute" in refused.message
    clock.advance(20)  # the first request's second has left the minute
    assert not isinstance(await admit(meter, p), Exception)
    assert isinstance(await admit(meter, p), errors.ResourceExhausted)


async def test_tokens_are_reserved_at_admission_and_settled_from_usage(redis, tmp_path):
    meter = Meter(redis, tmp_path, clock=FakeClock(T0).millis)
    p = who(tenant(), tpm=1000)
    first = await admit(meter, p, prompt=100, max_tokens=400)  # reserves 500
    second = await admit(meter, p, prompt=100, max_tokens=400)  # 1000
    assert isinstance(await admit(meter, p, prompt=100, max_tokens=400), errors.ResourceExhausted)
    await finish(meter, first, completion=50, prompt=100)  # used 150 of its 500
    assert not isinstance(await admit(meter, p, prompt=100, max_tokens=200), Exception)  # 150 + 500 + 300
    await meter.release(second)  # produced nothing: all 500 back
    assert not isinstance(await admit(meter, p, prompt=100, max_tokens=400), Exception)


async def test_a_request_larger_than_the_token_quota_is_told_so(redis, tmp_path):
    meter = Meter(redis, tmp_path, clock=FakeClock(T0).millis)
    refused = await admit(meter, who(tenant(), tpm=100), prompt=50, max_tokens=500)
    assert isinstance(refused, errors.ResourceExhausted) and refused.param == "max_tokens"
    assert refused.retry_after is None and "more than tenant" in refused.message


async def test_a_finished_request_frees_its_place(redis, tmp_path):
    meter = Meter(redis, tmp_path, clock=FakeClock(T0).millis)
    p = who(tenant(), concurrency=1)
    m = await admit(meter, p)
    assert isinstance(await admit(meter, p), errors.ResourceExhausted)
    await finish(meter, m, completion=3)
    assert not isinstance(await admit(meter, p), Exception)


async def test_the_place_of_a_router_that_died_lapses(redis, tmp_path):
    clock = FakeClock(T0)
    meter = Meter(redis, tmp_path, clock=clock.millis)
    p = who(tenant(), concurrency=1)
    await admit(meter, p)  # its router dies: never finished, never released
    assert isinstance(await admit(meter, p), errors.ResourceExhausted)
    clock.advance(16 * 60)
    assert not isinstance(await admit(meter, p), Exception)


async def test_two_routers_sharing_one_redis_admit_exactly_the_quota(redis_url, tmp_path):
    a, b = redisconn.connect(redis_url), redisconn.connect(redis_url)
    clock = FakeClock(T0)
    routers = [Meter(a, tmp_path / "a", clock=clock.millis), Meter(b, tmp_path / "b", clock=clock.millis)]
    p = who(tenant(), rpm=50)
    results = await asyncio.gather(*(admit(routers[i % 2], p) for i in range(200)))
    await a.aclose()
    await b.aclose()
    assert sum(not isinstance(r, Exception) for r in results) == 50


async def test_concurrency_counts_sequences_not_requests(redis, tmp_path):
    """n choices (or a list of prompts) run that many sequences at once in the engine: a tenant
    limited to 8 at once gets two requests with n=4, not eight."""
    meter = Meter(redis, tmp_path, clock=FakeClock(T0).millis)
    p = who(tenant(), concurrency=8)
    first, second = await admit(meter, p, sequences=4), await admit(meter, p, sequences=4)
    refused = await admit(meter, p, sequences=1)
    assert isinstance(refused, errors.ResourceExhausted) and "8 sequences in flight" in refused.message
    await finish(meter, first, completion=2)
    assert not isinstance(await admit(meter, p, sequences=4), Exception)
    alone = await admit(meter, who(tenant(), concurrency=8), sequences=16)
    assert isinstance(alone, errors.ResourceExhausted) and alone.param == "n" and alone.retry_after is None


async def test_an_older_routers_entries_count_one_sequence_each(redis, tmp_path):
    """Entries written before sequences were kept ("cost tokens second") count as one."""
    meter = Meter(redis, tmp_path, clock=FakeClock(T0).millis)
    p = who(tenant(), concurrency=2)
    await redis.hset(admission.inflight_key(p.tenant), "old-request", "0 0 1800000000")
    await redis.zadd(admission.inflight_exp_key(p.tenant), {"old-request": T0 * 1000 + 10**9})
    assert not isinstance(await admit(meter, p), Exception)
    assert isinstance(await admit(meter, p), errors.ResourceExhausted)


async def test_a_tenant_over_its_quota_by_this_routers_own_count_is_refused_before_anything_else(redis, tmp_path):
    """Meter.precheck, before the body is parsed: over its sequences at once by this router's own
    count, or refused by Redis on its requests a minute until the refusal's retry time."""
    clock = FakeClock(T0)
    local_clock = FakeClock()
    meter = Meter(redis, tmp_path, clock=clock.millis, local=LocalQuotas(clock=local_clock))
    busy = who(tenant(), concurrency=1)
    meter.precheck(busy)  # nothing known yet
    m = await admit(meter, busy)
    with pytest.raises(errors.ResourceExhausted, match="1 sequences in flight"):
        meter.precheck(busy)
    await finish(meter, m, completion=1)
    meter.precheck(busy)
    limited = who(tenant(), rpm=1)
    await admit(meter, limited)
    with pytest.raises(errors.ResourceExhausted, match="requests per minute"):
        meter.precheck(limited)  # this router's own count: 1 of 1 this minute
    # Another router has admitted none of them: Redis refuses it there, which it then remembers.
    other = Meter(redis, tmp_path / "other", clock=clock.millis, local=LocalQuotas(clock=local_clock))
    other.precheck(limited)
    assert isinstance(await admit(other, limited), errors.ResourceExhausted)
    with pytest.raises(errors.ResourceExhausted, match="requests per minute") as info:
        other.precheck(limited)
    assert info.value.retry_after >= 1
    local_clock.advance(61)
    clock.advance(61)
    meter.precheck(limited)
    other.precheck(limited)
