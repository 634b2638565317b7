"""The LoRA adapter catalogue in SQL (SQLite and PostgreSQL): every check refuses before anything
changes, with what to change; a removed and re-added adapter gets a new engine id."""

import json
import re

import pytest

from gaas.contracts import errors
from gaas.contracts.adapters import Adapter
from gaas.contracts.pricing import Price
from gaas.model.lora import build_adapter
from gaas.runtime.sql import Database
from services.control.adapters import AdapterStore, serving_limits

LORA_POOL = {"engine": {"max_loras": 2, "max_lora_rank": 8}}


def llama_config(hidden=128, layers=2, heads=2, kv=1) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": 4 * hidden}


@pytest.fixture
def files(tmp_path):
    """A base model (its config), an adapter for it, one of rank 16, and one made for a wider model."""
    base, wide = tmp_path / "base", tmp_path / "wide"
    for d, cfg in ((base, llama_config()), (wide, llama_config(hidden=256, heads=4))):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    return {"base": base, "a": build_adapter(base, tmp_path / "a", rank=8),
            "r16": build_adapter(base, tmp_path / "r16", rank=16), "wide": build_adapter(wide, tmp_path / "w", rank=8)}


@pytest.fixture
async def store(database_url):
    db = Database(database_url)
    db.execute_sync("DROP TABLE IF EXISTS lora_adapters")
    db.execute_sync("DELETE FROM schema_migrations WHERE component = 'control-adapters'") if _has_migrations(db) else None
    s = AdapterStore(db, clock=lambda: 1_700_000_000.0)
    await s.init_schema()
    yield s
    db.execute_sync("DROP TABLE IF EXISTS lora_adapters")
    db.close()


def _has_migrations(db) -> bool:
    try:
        db.execute_sync("SELECT 1 FROM schema_migrations")
        return True
    except Exception:  # noqa: BLE001 - a fresh database
        return False


def deployed(files, pools=(LORA_POOL,)):
    return {"tiny": (str(files["base"]), list(pools)), "small": (str(files["base"]), [])}


async def test_an_adapter_is_catalogued_listed_and_removed(store, files):
    a = await store.add(Adapter("bot", "tiny", str(files["a"]), 0, owner="acme", price=Price(1, 0.1, 4)),
                        models=deployed(files), tenants={"acme"})
    assert (a.rank, a.owner, a.price, a.adapter_id > 0) == (8, "acme", Price(1, 0.1, 4), True)
    assert await store.list() == [a] and await store.list("small") == []
    assert await store.remove("bot") == a
    assert await store.list() == []


async def test_an_adapter_added_again_gets_a_new_engine_id(store, files):
    first = await store.add(Adapter("bot", "tiny", str(files["a"]), 0), models=deployed(files), tenants=set())
    await store.remove("bot")
    store._clock = lambda: 1_700_000_001.0
    again = await store.add(Adapter("bot", "tiny", str(files["a"]), 0), models=deployed(files), tenants=set())
    assert again.adapter_id != first.adapter_id, "a worker's cached copy of the old one is never served for it"


@pytest.mark.parametrize("change, error, says", [
    ({"name": "Bad Name"}, errors.InvalidArgument, "lower-case"),
    ({"name": "tiny"}, errors.AlreadyExists, "a model's name"),
    ({"base_model": "huge"}, errors.NotFound, "not deployed"),
    ({"base_model": "small"}, errors.FailedPrecondition, "max_loras"),
    ({"owner": "nobody"}, errors.NotFound, "gaas tenant list"),
    ({"path": "relative/dir"}, errors.InvalidArgument, "absolute"),
    ({"path": "r16"}, errors.InvalidArgument, "over the pool's limit of 8"),
    ({"path": "wide"}, errors.InvalidArgument, "made for another model"),
    ({"path": "base"}, errors.InvalidArgument, "not a PEFT adapter"),
    ({"price": Price(-1, 0, 0)}, errors.InvalidArgument, "0 or more"),
])
async def test_a_bad_adapter_is_refused_before_anything_changes(store, files, change, error, says):
    fields = {"name": "bot", "base_model": "tiny", "path": str(files["a"]), "rank": 0, "owner": ""}
    if change.get("path") in files:
        change = {"path": str(files[change["path"]])}
    fields.update(change)
    with pytest.raises(error, match=says):
        await store.add(Adapter(**fields), models=deployed(files), tenants={"acme"})
    assert await store.list() == []


async def test_a_name_is_taken_once(store, files):
    await store.add(Adapter("bot", "tiny", str(files["a"]), 0), models=deployed(files), tenants=set())
    with pytest.raises(errors.AlreadyExists, match="gaas lora remove bot"):
        await store.add(Adapter("bot", "tiny", str(files["a"]), 0), models=deployed(files), tenants=set())
    with pytest.raises(errors.NotFound, match="gaas lora list"):
        await store.remove("other")


def test_the_rank_limit_is_the_lowest_of_the_pools_that_serve_adapters():
    pools = [{"engine": {"max_loras": 1, "max_lora_rank": 32}}, {"engine": {"max_loras": 2, "max_lora_rank": 8}},
             {"engine": {}}]
    assert serving_limits(pools) == (2, 8)
    assert serving_limits([{"engine": {}}]) == (0, 0)


@pytest.mark.parametrize("engine, says", [
    ("{}", "keep its engine's max_loras above 0"),
    ("{max_loras: 2, max_lora_rank: 8}", "max_lora_rank 8 is below the rank of its adapter(s) bot (16): keep it at 16"),
])
def test_a_file_that_would_leave_an_adapter_unservable_is_refused_where_it_says_so(tmp_path, engine, says):
    from gaas.settings.deployspec import SpecError, parse_text
    from services.control.adapters import still_served

    text = f"models:\n  - name: tiny\n    version: '1'\n    source: /m/t\n    engine: {engine}\n"
    check = still_served([Adapter("bot", "tiny", "/a", 16)])
    with pytest.raises(SpecError, match=re.escape(says)) as e:
        parse_text(text, tmp_path, "gaas.yaml", check)
    assert "gaas.yaml:" in str(e.value), "placed in the file"
    parse_text(text.replace(engine, "{max_loras: 1, max_lora_rank: 16}"), tmp_path, "gaas.yaml", check)
    with pytest.raises(SpecError, match="tiny serve.*bot.*gaas lora remove"):
        parse_text(text.replace("name: tiny", "name: other"), tmp_path, "gaas.yaml", check)


CLASH = ("models:\n  - name: tiny\n    version: '1'\n    source: /m/t\n    engine: {max_loras: 1, max_lora_rank: 16}\n"
         "  - name: bot\n    version: '1'\n    source: /m/b\n")


def test_a_file_whose_model_takes_an_adapters_name_is_refused_naming_both_and_the_entry(tmp_path):
    from gaas.settings.deployspec import SpecError, parse_text
    from services.control.adapters import apply_checks

    check = apply_checks([Adapter("bot", "tiny", "/a", 16, owner="acme")])
    with pytest.raises(SpecError) as e:
        parse_text(CLASH, tmp_path, "gaas.yaml", check)
    assert str(e.value).startswith("gaas.yaml:6: models[1].name: model bot would take the name of LoRA adapter bot "
                                   "(on tiny, tenant acme's)"), str(e.value)
    assert "gaas lora remove bot" in str(e.value)
    parse_text(CLASH.replace("name: bot", "name: other"), tmp_path, "gaas.yaml", check)


async def test_applying_a_model_named_as_an_adapter_changes_nothing(sql_deployment):
    from gaas.settings.deployspec import SpecError
    from services.control.adapters import apply_checks

    deployment, _ = sql_deployment
    check = apply_checks([Adapter("bot", "tiny", "/a", 16)])
    with pytest.raises(SpecError, match=r"models\[1\]\.name: model bot would take the name of LoRA adapter bot"):
        await deployment.apply_file(CLASH, "/d/gaas.yaml", "test", check=check)
    assert (await deployment.view()).revision == 0
    number, _ = await deployment.apply_file(CLASH.replace("name: bot", "name: other"), "/d/gaas.yaml", "test",
                                            check=check)
    assert number == 1
