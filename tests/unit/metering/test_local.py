"""The fallback while Redis does not answer (gaas.metering.local, gaas.metering.circuit through
Meter): a tenant is admitted by its own quotas shared among the live routers, a tenant without
limits is not limited, its budget's last room is shared too; Redis is not asked again for a
moment after it failed, and its return is noticed by the next request after that."""

import itertools
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gaas.contracts import errors, pricing
from gaas.contracts.principal import Principal
from gaas.contracts.qos import Limits
from gaas.metering import admission
from gaas.metering.circuit import RETRY_SECONDS, RedisCircuit
from gaas.metering.local import LocalQuotas, share
from gaas.metering.meter import Meter
from gaas.runtime import redisconn
from gaas.v1 import common_pb2
from tests.fakeclock import FakeClock

_ids = itertools.count()
T0 = 1_800_000_000  # a Unix moment (s) on a whole minute
PRICE = pricing.Price(input=1.0, cached_input=0.1, output=2.0)  # micro-dollars per token


def who(**limits) -> Principal:
    return Principal(f"f{next(_ids)}-{time.monotonic_ns()}", "silver", "key_f", "salt", Limits(**limits))


class Router:
    """One router's Meter on a fake clock, with routers sharing each tenant's quotas."""

    def __init__(self, redis, tmp_path, routers: int = 1) -> None:
        self.wall, self.clock = FakeClock(T0), FakeClock()
        self.meter = Meter(redis, tmp_path / f"spool-{next(_ids)}", clock=self.wall.millis,
                           local=LocalQuotas(clock=self.clock, routers=lambda: routers),
                           circuit=RedisCircuit(RETRY_SECONDS, self.clock))

    async def admit(self, p: Principal, prompt=10, max_tokens=10, sequences=1, price=pricing.FREE):
        """The request's handle, or its refusal."""
        try:
            return await self.meter.admit(p, f"{p.tenant}-{next(_ids)}", "m", "1", price, prompt, max_tokens, 1, "",
                                          time.perf_counter(), sequences=sequences)
        except errors.ResourceExhausted as exc:
            return exc

    async def finish(self, m, prompt: int, completion: int) -> None:
        c = common_pb2.GenerateChunk(token_ids=list(range(completion)), worker_id="w")
        c.usage.prompt_tokens, c.usage.completion_tokens = prompt, completion
        m.add(c)
        await self.meter.commit(m, "finished")


def refused(results) -> list[errors.ResourceExhausted]:
    return [r for r in results if isinstance(r, errors.ResourceExhausted)]


class DownRedis:
    """A Redis client that fails every call, counting them, until it is up (then ADMIT admits)."""

    def __init__(self) -> None:
        self.calls = 0
        self.up = False

    async def execute_command(self, *args):
        self.calls += 1
        if not self.up:
            raise RedisConnectionError("Connection refused")
        return [admission.ADMITTED, -1, 0, 0, 0] if args[0] in ("EVALSHA", "EVAL") else None


@pytest.mark.parametrize("limit, routers, expected", [
    (600, 2, 300), (600, 1, 600), (1, 2, 1), (10, 3, 4), (0, 4, 0),
])
def test_a_routers_share_of_a_quota_is_rounded_up_and_unlimited_stays_unlimited(limit, routers, expected):
    assert share(limit, routers) == expected


@pytest.fixture
def down():
    return DownRedis()


@pytest.mark.parametrize("limits, routers, requests, admitted, refused_by", [
    ({"rpm": 10}, 2, 8, 5, "requests per minute: 5"),
    ({"rpm": 10}, 1, 12, 10, "requests per minute: 10"),
    ({"concurrency": 8}, 2, 6, 4, "concurrent sequences: 4"),
    ({"tpm": 100}, 2, 5, 3, "tokens per minute: 50"),  # 20 tokens each: room left for a third
    ({"rpm": 3000, "tpm": 2_000_000, "concurrency": 64}, 2, 32, 32, None),
])
async def test_a_tenant_over_its_share_of_its_quotas_is_refused_in_the_fallback(
        down, tmp_path, limits, routers, requests, admitted, refused_by):
    router = Router(down, tmp_path, routers)
    p = who(**limits)
    results = [await router.admit(p) for _ in range(requests)]
    assert requests - len(refused(results)) == admitted
    if refused_by:
        assert {r.quota.description for r in refused(results)} == {refused_by}
        assert all(r.retry_after >= 1 for r in refused(results))
        if routers > 1:
            assert all(f"each of the {routers} routers admits its share" in r.message for r in refused(results))


async def test_a_tenant_without_limits_is_not_limited_by_the_fallback(down, tmp_path):
    router = Router(down, tmp_path, routers=2)
    p = who()
    results = [await router.admit(p, prompt=1000, max_tokens=4000, sequences=4) for _ in range(2000)]
    assert refused(results) == [], "thousands a minute, thousands at once: it has no limits"


async def test_a_request_alone_fits_a_routers_share_even_when_larger_than_it(down, tmp_path):
    """A router's share of 8 sequences at once among 2 routers is 4: a request of 8 alone is within
    the tenant's quota, and is admitted; one larger than the whole quota is refused as Redis would."""
    router = Router(down, tmp_path, routers=2)
    p = who(concurrency=8, tpm=1000)
    assert not isinstance(await router.admit(p, sequences=8), Exception)
    assert isinstance(await router.admit(p), errors.ResourceExhausted)
    too_many = await router.admit(who(concurrency=8), sequences=9)
    assert isinstance(too_many, errors.ResourceExhausted) and too_many.param == "n"
    too_large = await router.admit(who(tpm=1000), prompt=500, max_tokens=501)
    assert isinstance(too_large, errors.ResourceExhausted) and too_large.param == "max_tokens"


async def test_the_minute_of_the_fallback_counts_what_requests_used_once_they_ended(down, tmp_path):
    router = Router(down, tmp_path)
    p = who(tpm=100)
    first = await router.admit(p, prompt=10, max_tokens=90)  # 100 reserved
    assert isinstance(await router.admit(p, prompt=10, max_tokens=10), errors.ResourceExhausted)
    await router.finish(first, prompt=10, completion=5)  # it used 15 (its usage is spooled)
    assert not isinstance(await router.admit(p, prompt=10, max_tokens=10), Exception)
    router.clock.advance(60)
    assert not isinstance(await router.admit(p, prompt=10, max_tokens=90), Exception), "the minute slid"


async def test_redis_is_not_asked_again_for_a_moment_after_it_failed_and_its_return_is_noticed_after(
        down, tmp_path):
    """While Redis is away only one request each RETRY_SECONDS waits on it; the first request after
    that once it is back is admitted by Redis."""
    router = Router(down, tmp_path)
    p = who(rpm=100)
    for _ in range(10):
        assert not isinstance(await router.admit(p), Exception)
    assert down.calls == 1, "the failure opened the circuit: the others were admitted at once"
    router.clock.advance(RETRY_SECONDS)
    await router.admit(p)
    await router.admit(p)
    assert down.calls == 2, "one request tried Redis again"
    down.up = True
    await router.admit(p)
    assert down.calls == 2, "(not yet: the moment has not passed)"
    router.clock.advance(RETRY_SECONDS)
    m = await router.admit(p)
    assert down.calls == 3 and m.admitted, "the next request after the moment: admitted by Redis"
    await router.admit(p)
    assert down.calls == 4, "and every one after it"


async def test_usage_is_spooled_without_waiting_on_redis_while_it_is_away(down, tmp_path):
    router = Router(down, tmp_path)
    p = who()
    ms = [await router.admit(p) for _ in range(3)]
    for m in ms:
        await router.finish(m, prompt=10, completion=2)
    assert router.meter.spooled == 3 and down.calls == 1


async def test_a_tenant_within_its_quotas_is_not_refused_while_redis_is_away_nor_after_it_returns(
        redis_process, tmp_path):
    """The soak's case: Redis killed (-9) and back within a second, a tenant far inside its quotas
    (two routers, each admitting half of its traffic) sees no refusal; the request after Redis is
    back (and RETRY_SECONDS passed) is counted in Redis again."""
    client = redisconn.connect(redis_process.url, timeout=1.0, retries=1)  # (as the router's)
    try:
        router = Router(client, tmp_path, routers=2)
        p = who(rpm=600, tpm=200_000, concurrency=64)
        before = [await router.admit(p) for _ in range(10)]  # in flight through the kill
        for _ in range(140):  # its half of 300 requests a minute
            m = await router.admit(p)
            before.append(m)
            if not isinstance(m, Exception):
                await router.finish(m, prompt=10, completion=10)
        assert refused(before) == [] and all(m.admitted for m in before)
        redis_process.kill()
        away = []
        for i in range(100):
            away.append(m := await router.admit(p))
            if not isinstance(m, Exception) and i >= 10:
                await router.finish(m, prompt=10, completion=10)  # (spooled)
        assert refused(away) == [] and not any(m.admitted for m in away)
        redis_process.start()
        router.clock.advance(RETRY_SECONDS)
        router.wall.advance(1)
        back = await router.admit(p)
        assert not isinstance(back, Exception) and back.admitted, "Redis admits again"
        assert await client.hexists(admission.inflight_key(p.tenant), back.request_id)
        after = [await router.admit(p) for _ in range(40)]
        assert refused(after) == [] and all(m.admitted for m in after)
        assert await router.meter.drain_spool() == 90
    finally:
        await client.aclose()


async def test_a_tenant_over_its_quota_is_still_refused_while_redis_is_away_and_after(redis_process, tmp_path):
    client = redisconn.connect(redis_process.url, timeout=1.0, retries=1)
    try:
        router = Router(client, tmp_path, routers=2)
        p = who(rpm=20)
        assert refused([await router.admit(p) for _ in range(8)]) == []
        redis_process.kill()
        away = [await router.admit(p) for _ in range(5)]
        assert len(refused(away)) == 3, "its share, 10 a minute, of which 8 were admitted through Redis"
        redis_process.start()  # (empty: it forgot the minute)
        router.clock.advance(RETRY_SECONDS)
        back = [await router.admit(p) for _ in range(25)]
        assert len(refused(back)) == 5 and "quota is 20 requests per minute" in refused(back)[0].message
    finally:
        await client.aclose()


async def test_the_budgets_last_room_is_shared_among_the_routers_while_redis_is_away(redis_process, tmp_path):
    """The room Redis reported with the tenant's last admission here, divided among the routers,
    less the most each request admitted since could cost; a tenant this router never admitted
    through Redis is admitted without a budget check (its usage is billed once Redis is back)."""
    client = redisconn.connect(redis_process.url, timeout=1.0, retries=1)
    try:
        router = Router(client, tmp_path, routers=2)
        p = who()
        await client.set(admission.budget_key(p.tenant), 1000 + 120)  # room for the first and 1000 more
        assert (await router.admit(p, prompt=20, max_tokens=50, price=PRICE)).admitted  # may cost 120
        redis_process.kill()
        away = [await router.admit(p, prompt=20, max_tokens=50, price=PRICE) for _ in range(6)]
        assert len(refused(away)) == 2, "500 of the 1000 left are this router's: four requests of 120"
        assert all(r.reason == "insufficient_quota" for r in refused(away))
        unseen = who()
        assert refused([await router.admit(unseen, price=PRICE) for _ in range(3)]) == []
    finally:
        await client.aclose()
