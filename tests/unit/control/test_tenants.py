import pytest

from gaas.runtime.sql import Database
from services.control.tenants import TABLES, AlreadyExists, NotFound, TenantError, TenantStore, hash_key


@pytest.fixture
async def store(database_url):
    db = Database(database_url)
    for table in TABLES:
        db.execute_sync(f"DROP TABLE IF EXISTS {table}")
    s = TenantStore(db)
    await s.init_schema()
    s.db = db
    yield s
    for table in TABLES:
        db.execute_sync(f"DROP TABLE IF EXISTS {table}")
    db.close()


async def test_tenants(store):
    a = await store.create_tenant("acme", "gold")
    await store.create_tenant("beta", "bronze")
    assert [t.name for t in await store.list_tenants()] == ["acme", "beta"]
    assert a.tier == "gold" and len(a.cache_salt) == 32
    with pytest.raises(AlreadyExists):
        await store.create_tenant("acme", "gold")


@pytest.mark.parametrize("name, tier, message", [("Acme Corp", "gold", "lower-case"), ("acme", "platinum", "tier must be"),
                                                 ("acme\n", "gold", "lower-case")])
async def test_bad_tenants(store, name, tier, message):
    with pytest.raises(TenantError, match=message):
        await store.create_tenant(name, tier)


async def test_keys_are_stored_hashed_and_authenticate(store):
    await store.create_tenant("acme", "gold")
    key, secret = await store.create_key("acme")
    assert secret.startswith("gaas_") and len(secret) > 40 and secret.startswith(key.prefix)
    stored = store.db.execute_sync("SELECT key_hash FROM api_keys")
    assert stored == [(hash_key(secret),)]
    assert secret not in repr(store.db.execute_sync("SELECT * FROM api_keys"))
    tenant, found = await store.authenticate(secret)
    assert (tenant.name, found.key_id) == ("acme", key.key_id)
    assert await store.authenticate(secret + "x") is None


async def test_revoke(store):
    await store.create_tenant("acme", "gold")
    key, secret = await store.create_key("acme")
    other, other_secret = await store.create_key("acme")
    revoked = await store.revoke_key(key.key_id)
    assert revoked.revoked_ms > 0
    assert await store.authenticate(secret) is None
    assert await store.authenticate(other_secret) is not None
    assert (await store.revoke_key(key.key_id)).revoked_ms == revoked.revoked_ms  # idempotent
    with pytest.raises(NotFound, match="gaas key list"):
        await store.revoke_key("key_nope")


async def test_keys_need_a_tenant_and_list_by_tenant(store):
    with pytest.raises(NotFound, match="create it first"):
        await store.create_key("ghost")
    await store.create_tenant("a", "gold")
    await store.create_tenant("b", "gold")
    await store.create_key("a")
    await store.create_key("b")
    assert [k.tenant for k in await store.list_keys("b")] == ["b"]
    assert len(await store.list_keys()) == 2


async def test_a_tenants_own_quotas_override_its_tiers_until_reset(store):
    from gaas.contracts import qos
    from services.control.servicer import tenant_to_pb

    await store.create_tenant("acme", "bronze")
    tier = qos.DEFAULT_POLICIES["bronze"].limits
    pb = tenant_to_pb(await store.get_tenant("acme"))
    assert (pb.limits.rpm, pb.limits.tpm, pb.limits.concurrency) == (tier.rpm, tier.tpm, tier.concurrency)
    assert list(pb.own_limits) == []
    await store.update_tenant("acme", limits={"rpm": 60, "concurrency": 0})
    t = await store.update_tenant("acme", limits={"tpm": 1000})
    assert t.own_limits == (60, 1000, 0)
    pb = tenant_to_pb(t)
    assert (pb.limits.rpm, pb.limits.tpm, pb.limits.concurrency) == (60, 1000, 0) and list(pb.own_limits) == [
        "rpm", "tpm", "concurrency"]
    t = await store.update_tenant("acme", limits={"rpm": None})
    assert t.own_limits == (None, 1000, 0) and tenant_to_pb(t).limits.rpm == tier.rpm
    with pytest.raises(TenantError, match="rpm must be between 0"):
        await store.update_tenant("acme", limits={"rpm": -5})
    with pytest.raises(TenantError, match="unknown quota"):
        await store.update_tenant("acme", limits={"rph": 5})
    found, _ = await store.authenticate((await store.create_key("acme"))[1])
    assert found.own_limits == (None, 1000, 0)
