import pytest

from gaas.runtime.sql import Database
from services.billing.ledger import Ledger
from tests.sqlurls import database_urls, make_url

ROWS = [
    ("r1", "acme", 1000),
    ("r2", "acme", 2000),
    ("r3", "acme", 3000),
    ("r4", "other", 2000),
]


@pytest.fixture(params=database_urls())
async def ledger(request, tmp_path):
    db = Database(make_url(request.param, tmp_path))
    db.execute_sync("DROP TABLE IF EXISTS usage_ledger")
    ledger = Ledger(db)
    await ledger.init_schema()
    for rid, tenant, ts in ROWS:
        await db.execute(
            "INSERT INTO usage_ledger VALUES (?, ?, 'gaas-tiny', '1.0.0', 10, 4, 5, ?)", (rid, tenant, ts)
        )
    yield ledger
    db.execute_sync("DROP TABLE IF EXISTS usage_ledger")
    db.close()


@pytest.mark.parametrize(
    "tenant, start, end, requests",
    [("acme", 0, 0, 3), ("acme", 2000, 0, 2), ("acme", 0, 3000, 2), ("other", 0, 0, 1), ("nobody", 0, 0, 0)],
)
async def test_totals(ledger, tenant, start, end, requests):
    t = await ledger.totals(tenant, start, end)
    assert (t.requests, t.prompt_tokens, t.cached_tokens, t.completion_tokens) == (
        requests, 10 * requests, 4 * requests, 5 * requests
    )
