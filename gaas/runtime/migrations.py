"""Versioned schema migrations for a component's tables: each step runs once, in order, in a
transaction that also records it, so a restart (or a second replica) never applies one twice."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from gaas.runtime.sql import Database

log = logging.getLogger(__name__)

TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations (
    component TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_ms BIGINT NOT NULL,
    PRIMARY KEY (component, version)
)"""


async def migrate(db: Database, component: str, steps: Sequence[Sequence[str]]) -> int:
    """Apply the steps (each a list of statements) not applied yet; returns the schema version."""
    await db.execute(TABLE)

    def apply(version: int, statements: Sequence[str]):
        def run(execute) -> bool:
            done = execute("SELECT 1 FROM schema_migrations WHERE component = ? AND version = ?", (component, version))
            if done:
                return False
            for statement in statements:
                execute(statement)
            execute("INSERT INTO schema_migrations (component, version, applied_ms) VALUES (?, ?, ?)",
                    (component, version, int(time.time() * 1000)))
            return True

        return run

    for version, statements in enumerate(steps, start=1):
        if await db.run(apply(version, statements)):
            log.info("%s schema: applied migration %d", component, version)
    return len(steps)
