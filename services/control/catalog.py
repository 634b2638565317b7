"""The model catalogue: the models of the applied deployment file, kept in SQL."""

from __future__ import annotations

import time

from gaas.deployspec import DeploySpec, ModelSpec
from gaas.runtime.sql import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    version TEXT NOT NULL,
    source TEXT NOT NULL,
    preset TEXT NOT NULL,
    max_model_len INTEGER NOT NULL,
    is_default INTEGER NOT NULL,
    applied_ms BIGINT NOT NULL
)
"""


class ModelCatalog:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def init_schema(self) -> None:
        await self._db.execute(SCHEMA)

    async def apply(self, spec: DeploySpec) -> None:
        """Make the catalogue exactly the file's models (declarative: models not listed go away)."""
        now = int(time.time() * 1000)
        statements: list[tuple[str, tuple]] = [("DELETE FROM models", ())]
        for m in spec.models:
            statements.append(
                (
                    "INSERT INTO models (name, version, source, preset, max_model_len, is_default, applied_ms)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (m.name, m.version, m.source, m.preset, m.max_model_len, int(m is spec.default_model), now),
                )
            )
        await self._db.transaction(statements)

    async def list(self) -> list[ModelSpec]:
        rows = await self._db.execute(
            "SELECT name, version, source, preset, max_model_len, is_default FROM models ORDER BY name"
        )
        return [ModelSpec(n, v, s, p, int(ml), bool(d)) for n, v, s, p, ml, d in rows]
