import pytest

from gaas.settings.deployspec import parse
from gaas.runtime.sql import Database
from services.control.catalog import ModelCatalog


@pytest.fixture
async def catalog(database_url):
    db = Database(database_url)
    db.execute_sync("DROP TABLE IF EXISTS models")
    cat = ModelCatalog(db)
    await cat.init_schema()
    yield cat
    db.execute_sync("DROP TABLE IF EXISTS models")
    db.close()


async def test_apply_is_declarative(catalog, tmp_path):
    first = parse({"models": [{"name": "a", "source": "/x"}, {"name": "b", "source": "/y", "default": True}]}, tmp_path)
    await catalog.apply(first)
    models = await catalog.list()
    assert [(m.name, m.is_default) for m in models] == [("a", False), ("b", True)]

    second = parse({"models": [{"name": "c", "source": "/z", "version": "2.0", "max_model_len": 512}]}, tmp_path)
    await catalog.apply(second)
    (only,) = await catalog.list()
    assert (only.name, only.version, only.max_model_len, only.is_default) == ("c", "2.0", 512, True)


def test_unsupported_url():
    with pytest.raises(ValueError, match="unsupported database URL"):
        Database("mysql://x")
