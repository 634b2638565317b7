"""What each tenant holds in Redis for `gaas top` (gaas/ops/tenantstorage.py), against a real Redis:
the tenants holding anything, the most first, each with the cap its router applied, expired entries
no longer counted."""

import redis as redis_sync

from gaas.contracts.sessions import SessionPolicy
from gaas.ops.tenantstorage import held_by_tenant
from services.router.responses import ResponseStore
from tests.fakeclock import FakeClock


async def test_each_tenant_holding_anything_is_listed_the_most_first_with_its_cap(redis, redis_url):
    clock = FakeClock(1_800_000_000)
    store = ResponseStore(redis, SessionPolicy(response_ttl_seconds=60, max_bytes_per_tenant=10**6), clock=clock.millis)
    await store.put("small", "resp_1", {"response": {"status": "completed"}, "v": 1})
    await store.put("large", "resp_1", {"response": {"status": "completed", "text": "x" * 5000}, "v": 1})
    client = redis_sync.Redis.from_url(redis_url, decode_responses=True)
    try:
        rows = held_by_tenant(client, ["idle", "small", "large"], clock.millis())
        assert [(r["tenant"], r["cap"]) for r in rows] == [("large", 10**6), ("small", 10**6)]
        assert rows[0]["bytes"] > 5000 > rows[1]["bytes"] > 0
        clock.advance(61)
        assert held_by_tenant(client, ["idle", "small", "large"], clock.millis()) == []
        assert held_by_tenant(client, [], clock.millis()) == []
    finally:
        client.close()
