import pytest

from gaas.runtime.sql import Database
from services.control.tenants import AlreadyExists, NotFound, TenantError, TenantStore, hash_key
from tests.sqlurls import database_urls, make_url


@pytest.fixture(params=database_urls())
async def store(request, tmp_path):
    db = Database(make_url(request.param, tmp_path))
    for table in ("api_keys", "tenant_billing", "tenants"):
        db.execute_sync(f"DROP TABLE IF EXISTS {table}")
    s = TenantStore(db)
    await s.init_schema()
    s.db = db
    yield s
    for table in ("api_keys", "tenant_billing", "tenants"):
        db.execute_sync(f"DROP TABLE IF EXISTS {table}")
    db.close()


async def test_tenants(store):
    a = await store.create_tenant("acme", "gold")
    await store.create_tenant("beta", "bronze")
    assert [t.name for t in await store.list_tenants()] == ["acme", "beta"]
    assert a.tier == "gold" and len(a.cache_salt) == 32
    with pytest.raises(AlreadyExists):
        await store.create_tenant("acme", "gold")


@pytest.mark.parametrize("name, tier, message", [("Acme Corp", "gold", "lower-case"), ("acme", "platinum", "tier must be")])
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
