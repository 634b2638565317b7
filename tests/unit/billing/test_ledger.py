"""The ledger on SQLite and PostgreSQL: migrations from the first schema, a request recorded once
however often its event arrives, sums per group, budgets, dead letters."""

import pytest

from gaas.contracts.usage import UsageEvent
from gaas.runtime.sql import Database
from services.billing.ledger import MIGRATIONS, Ledger

TABLES = ("usage_ledger", "budgets", "dead_letters", "stripe_outbox", "schema_migrations")


def event(rid, tenant="acme", ms=1000, prompt=10, cached=4, completion=5, model="m", key="key_1", session="",
          adapter=""):
    return UsageEvent(rid, tenant, key, "gold", model, "1", prompt, cached, completion, 6 * (prompt - cached),
                      cached, 20 * completion, "finished", "worker-0", ms, session_id=session, adapter=adapter)


@pytest.fixture
async def db(database_url):
    d = Database(database_url)
    for t in TABLES:
        d.execute_sync(f"DROP TABLE IF EXISTS {t}")
    yield d
    for t in TABLES:
        d.execute_sync(f"DROP TABLE IF EXISTS {t}")
    d.close()


async def test_a_request_is_recorded_once_however_often_it_arrives(db):
    ledger = Ledger(db)
    await ledger.init_schema()
    assert await ledger.record([event("r1"), event("r2"), event("r1")]) == 2
    assert await ledger.record([event("r2"), event("r3")]) == 1
    total = await ledger.totals("acme")
    assert (total.requests, total.prompt_tokens, total.cached_tokens, total.completion_tokens) == (3, 30, 12, 15)
    assert total.cost_micros == 3 * (36 + 4 + 100)


async def test_a_supplement_adds_its_tokens_and_cost_but_is_not_another_request(db):
    from dataclasses import replace

    from gaas.contracts.usage import SUPPLEMENT

    ledger = Ledger(db)
    await ledger.init_schema()
    more = replace(event("r1+9", prompt=0, cached=0, completion=4), outcome=SUPPLEMENT)
    assert await ledger.record([event("r1"), more]) == 2
    total = await ledger.totals("acme")
    assert (total.requests, total.prompt_tokens, total.completion_tokens) == (1, 10, 9)
    assert [line[:2] for line in await ledger.invoice_lines("acme", 0, 10_000)] == [("m", 1)]


async def test_usage_by_model_day_and_key_and_time_range(db):
    ledger = Ledger(db)
    await ledger.init_schema()
    day = 86_400_000
    await ledger.record([event("a", ms=1000, model="m1"), event("b", ms=day + 5, model="m2", key="key_2"),
                         event("c", ms=day + 9, model="m2"), event("d", tenant="other")])
    assert [(r.group, r.requests) for r in await ledger.usage("acme", group_by="model")] == [("m1", 1), ("m2", 2)]
    assert [(r.group, r.requests) for r in await ledger.usage("acme", group_by="day")] == [("1970-01-01", 1),
                                                                                          ("1970-01-02", 2)]
    assert [(r.group, r.requests) for r in await ledger.usage("acme", group_by="key")] == [("key_1", 2), ("key_2", 1)]
    assert (await ledger.totals("acme", day, 2 * day)).requests == 2
    assert (await ledger.totals("nobody")).requests == 0


async def test_usage_and_invoice_lines_by_lora_adapter(db):
    ledger = Ledger(db)
    await ledger.init_schema()
    await ledger.record([event("a"), event("b", adapter="bot"), event("c", adapter="bot"), event("d", adapter="pub")])
    assert [(r.group, r.requests) for r in await ledger.usage("acme", group_by="adapter")] == [
        ("m", 1), ("m:bot", 2), ("m:pub", 1)]
    assert [(line[0], line[1]) for line in await ledger.invoice_lines("acme", 0, 10_000)] == [
        ("m", 1), ("m:bot", 2), ("m:pub", 1)], "an adapter, priced apart, is its own line"


async def test_sessions_are_counted_in_the_tenants_usage_once_each(db):
    ledger = Ledger(db)
    await ledger.init_schema()
    await ledger.record([event("a", session="s1"), event("b", session="s1"), event("c", session="s2"), event("d"),
                         event("e", tenant="other", session="s3")])
    total = await ledger.totals("acme")
    assert (total.requests, total.sessions) == (4, 2), "two sessions of three turns; a request outside any is not one"
    assert [(r.group, r.sessions) for r in await ledger.usage("acme", group_by="model")] == [("m", 2)]


async def test_migrations_upgrade_the_first_schema_and_run_once(db):
    db.execute_sync(MIGRATIONS[0][0])  # a ledger as the first billing service left it, with a row
    db.execute_sync("INSERT INTO usage_ledger VALUES ('old', 'acme', 'm', '1', 1, 0, 1, 5)")
    ledger = Ledger(db)
    await ledger.init_schema()
    await ledger.init_schema()  # a restart: nothing applied twice
    assert (await ledger.totals("acme")).requests == 1
    versions = db.execute_sync("SELECT version FROM schema_migrations WHERE component = 'billing' ORDER BY version")
    assert [v for (v,) in versions] == list(range(1, len(MIGRATIONS) + 1))
    await ledger.record([event("new")])
    assert (await ledger.totals("acme")).requests == 2


async def test_budgets_and_dead_letters(db):
    ledger = Ledger(db)
    await ledger.init_schema()
    await ledger.set_budget("acme", 5_000_000)
    await ledger.set_budget("beta", 1)
    await ledger.set_budget("beta", 0)
    assert await ledger.budgets() == {"acme": 5_000_000}
    await ledger.dead_letter("1-0", "{'x': 1}", "usage event without request_id")
    await ledger.dead_letter("1-0", "{'x': 1}", "again")
    assert await ledger.dead_letters() == 1
