"""Stored responses (services/router/responses.py) against a real Redis, and the bytes a tenant may
hold through them and its sessions (gaas/contracts/tenantbytes.py): the attack of issue 44 replayed
(one tenant storing large responses until the shared Redis is full) is refused at the tenant's cap
with a 429 that says what to do, while other tenants are served; deleting, the count cap, overwrites
and expiry give the bytes back."""

import pytest

from gaas.contracts import errors, tenantbytes
from gaas.contracts.sessions import Context, SessionPolicy, Turn
from services.router.responses import ResponseStore
from services.router.sessions import SessionStore
from tests.fakeclock import FakeClock

SCHEMA = "x" * (64 * 1024)


def record(text: str = SCHEMA) -> dict:
    """A stored response as large as one echoing a 64 KiB schema."""
    return {"response": {"id": "r", "status": "completed", "text": {"format": {"schema": text}}},
            "input_items": [], "conversation": [], "v": 1}


async def test_a_tenant_storing_large_responses_is_refused_at_its_cap_and_others_are_still_served(redis):
    store = ResponseStore(redis, SessionPolicy())
    cap = SessionPolicy().max_bytes_per_tenant
    stored = 0
    with pytest.raises(errors.ResourceExhausted) as info:
        for i in range(2000):
            await store.put("mallory", f"resp_{i}", record())
            stored += 1
    assert 0 < stored < 2000
    err = info.value
    assert err.reason == "storage_limit" and err.quota.subject == "tenant:mallory"
    assert "48.0 MiB" in err.message and '"store": false' in err.message and "DELETE /v1/responses/ID" in err.message
    assert cap - len(SCHEMA) * 2 < await store.held("mallory") <= cap
    with pytest.raises(errors.ResourceExhausted):
        await store.room("mallory", record())  # (refused before its generation too)
    # The refused response was not written; another tenant is served as before.
    with pytest.raises(errors.NotFound):
        await store.get("mallory", f"resp_{stored}")
    await store.room("alice", record())
    await store.put("alice", "resp_a", record())
    assert (await store.get("alice", "resp_a"))["v"] == 1


async def test_deleting_a_stored_response_gives_its_bytes_back(redis):
    store = ResponseStore(redis, SessionPolicy(max_bytes_per_tenant=3 * len(SCHEMA)))
    await store.put("acme", "resp_1", record())
    await store.put("acme", "resp_2", record())
    with pytest.raises(errors.ResourceExhausted):
        await store.put("acme", "resp_3", record())
    await store.delete("acme", "resp_1")
    assert await store.held("acme") < 2 * len(SCHEMA)
    await store.put("acme", "resp_3", record())


async def test_an_overwrite_counts_once_and_a_shrinking_one_is_let_through_at_the_cap(redis):
    store = ResponseStore(redis, SessionPolicy(max_bytes_per_tenant=len(SCHEMA) + 1000))
    small = await store.put("acme", "resp_1", record("y"))
    big = await store.put("acme", "resp_1", record())
    assert await store.put("acme", "resp_1", record()) == big > small
    with pytest.raises(errors.ResourceExhausted):
        await store.put("acme", "resp_2", record("y" * 2000))
    assert await store.put("acme", "resp_1", record("y")) == small  # (a background response's failure fits)


async def test_responses_dropped_past_the_count_cap_give_their_bytes_back(redis):
    store = ResponseStore(redis, SessionPolicy(max_responses_per_tenant=2))
    one = await store.put("acme", "resp_1", record())
    await store.put("acme", "resp_2", record())
    assert await store.put("acme", "resp_3", record()) == 2 * one
    with pytest.raises(errors.NotFound):
        await store.get("acme", "resp_1")


async def test_expired_responses_no_longer_count_against_the_cap(redis):
    clock = FakeClock(1_800_000_000)
    policy = SessionPolicy(response_ttl_seconds=60, max_bytes_per_tenant=2 * len(SCHEMA))
    store = ResponseStore(redis, policy, clock=clock.millis)
    await store.put("acme", "resp_1", record())
    with pytest.raises(errors.ResourceExhausted):
        await store.put("acme", "resp_2", record())
    clock.advance(61)
    assert await store.held("acme") == 0
    await store.put("acme", "resp_2", record())


async def test_a_tenant_that_keeps_nothing_leaves_no_accounting_behind(redis):
    store = ResponseStore(redis, SessionPolicy())
    await store.put("acme", "resp_1", record("y"))
    await store.delete("acme", "resp_1")
    assert await store.held("acme") == 0
    assert not await redis.exists(tenantbytes.held_key("acme"), tenantbytes.held_until_key("acme"))


# ------------------------------------------------------------------ sessions share the cap


def context(reply: str) -> Context:
    return Context(model="tiny", kind="chat", turns=[Turn([("user", "hi")], reply, 10)])


async def commit_turn(sessions: SessionStore, tenant: str, session_id: str, request_id: str, reply: str) -> None:
    held = await sessions.begin(tenant, session_id, request_id)
    await sessions.commit(held, context(reply))


async def test_a_tenant_at_its_cap_is_refused_a_session_turn_until_it_deletes_and_others_go_on(redis):
    policy = SessionPolicy(max_bytes_per_tenant=len(SCHEMA))
    sessions, responses = SessionStore(redis, policy), ResponseStore(redis, policy)
    await commit_turn(sessions, "acme", "s1", "req-1", SCHEMA)  # (let through below the cap: it commits)
    assert await responses.held("acme") > len(SCHEMA)
    with pytest.raises(errors.ResourceExhausted) as info:
        await sessions.begin("acme", "s2", "req-2")
    assert info.value.reason == "storage_limit" and "sessions" in info.value.message
    with pytest.raises(errors.ResourceExhausted):
        await responses.put("acme", "resp_1", record("y" * 2000))  # (one cap for both)
    await commit_turn(sessions, "other", "s1", "req-3", "short")
    await sessions.delete("acme", "s1")
    assert await responses.held("acme") == 0
    await commit_turn(sessions, "acme", "s2", "req-4", "short")


async def test_a_sessions_bytes_follow_its_context_as_turns_replace_it(redis):
    sessions, responses = SessionStore(redis, SessionPolicy()), ResponseStore(redis, SessionPolicy())
    await commit_turn(sessions, "acme", "s1", "req-1", SCHEMA)
    large = await responses.held("acme")
    await commit_turn(sessions, "acme", "s1", "req-2", "short")
    assert await responses.held("acme") < large - len(SCHEMA) // 2
