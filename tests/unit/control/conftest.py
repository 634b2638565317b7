"""Fixtures of the control plane's unit tests."""

from __future__ import annotations

import time

import pytest

from gaas.runtime.sql import Database
from services.control.catalog import ModelCatalog
from services.control.deployment import Deployment
from tests.fakeclock import FakeClock


@pytest.fixture
async def sql_deployment(tmp_path):
    """(a Deployment on a SQLite database of its own, its fake clock). The clock starts at the
    wall clock's now: the outcomes stream's entry ids are Redis's clock, which the driver reads by."""
    db = Database(f"sqlite:///{tmp_path / 'control.db'}")
    catalog = ModelCatalog(db)
    await catalog.init_schema()
    clock = FakeClock(time.time())
    deployment = Deployment(db, catalog, check_source=lambda m: None, clock=clock)
    await deployment.init_schema()
    yield deployment, clock
    db.close()
