import pytest

from gaas.runtime.sql import Database
from services.billing.ledger import Ledger


@pytest.fixture
async def ledger(tmp_path):
    """A migrated ledger on a fresh SQLite file (tests/unit/billing/test_ledger.py covers PostgreSQL too)."""
    db = Database(f"sqlite:///{tmp_path / 'billing.db'}")
    ledger = Ledger(db)
    await ledger.init_schema()
    yield ledger
    db.close()
