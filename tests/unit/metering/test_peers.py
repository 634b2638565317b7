"""Peers: each router counts the live routers in Redis (its entry renewed, lapsed ones dropped, a
stopped one's taken out), and keeps the last count while Redis is away."""

from gaas.metering.peers import LAPSE_SECONDS, ROUTERS_KEY, Peers
from gaas.runtime import redisconn
from tests.fakeclock import FakeClock

T0 = 1_800_000_000


async def test_each_router_counts_the_live_routers_and_a_lapsed_or_stopped_one_leaves_the_count(redis):
    await redis.delete(ROUTERS_KEY)
    clock = FakeClock(T0)
    a, b, c = (Peers(redis, name, clock=clock.millis) for name in ("router-a", "router-b", "router-c"))
    assert a.routers() == 1, "alone until counted"
    assert await a.beat() == 1
    assert await b.beat() == 2 and await c.beat() == 3
    assert await a.beat() == 3 and a.routers() == 3
    await c.leave()
    assert await a.beat() == 2
    clock.advance(LAPSE_SECONDS - 1)
    assert await a.beat() == 2
    clock.advance(2)  # b has not renewed its entry: it died
    assert await a.beat() == 1


async def test_while_redis_is_away_the_last_count_stands(redis_process):
    clock = FakeClock(T0)
    client, other = redisconn.connect(redis_process.url, retries=1), redisconn.connect(redis_process.url, retries=1)
    try:
        a, b = Peers(client, "router-a", clock=clock.millis), Peers(other, "router-b", clock=clock.millis)
        await a.beat()
        await b.beat()
        assert await a.beat() == 2
        redis_process.kill()
        assert await a.beat() == 2 and a.routers() == 2
        await a.leave()  # (nothing to do: its entry lapses)
    finally:
        await client.aclose()
        await other.aclose()
