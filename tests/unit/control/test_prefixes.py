"""Public prefixes in SQL (SQLite and PostgreSQL)."""

import pytest

from gaas.contracts import errors
from gaas.runtime.sql import Database
from services.control.prefixes import PrefixStore, prefix_id


@pytest.fixture
async def store(database_url):
    db = Database(database_url)
    db.execute_sync("DROP TABLE IF EXISTS public_prefixes")
    s = PrefixStore(db)
    await s.init_schema()
    yield s
    db.execute_sync("DROP TABLE IF EXISTS public_prefixes")
    db.close()


async def test_add_list_remove(store):
    p = await store.add("tiny", "You are helpful.", {"tiny", "small"})
    assert p.prefix_id == prefix_id("tiny", "You are helpful.") and p.prefix_id.startswith("pub_")
    again = await store.add("tiny", "You are helpful.", {"tiny"})
    assert again == p, "adding the same prefix twice keeps one"
    await store.add("small", "Other.", {"tiny", "small"})
    assert [x.model for x in await store.list()] == ["tiny", "small"]
    assert [x.text for x in await store.list("small")] == ["Other."]
    await store.remove(p.prefix_id)
    assert [x.model for x in await store.list()] == ["small"]


async def test_errors_name_what_to_fix(store):
    with pytest.raises(errors.NotFound, match="not deployed"):
        await store.add("huge", "x", {"tiny"})
    with pytest.raises(errors.InvalidArgument, match="needs text"):
        await store.add("tiny", "  ", {"tiny"})
    with pytest.raises(errors.NotFound, match="gaas kv public list"):
        await store.remove("pub_nothing")
