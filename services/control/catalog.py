"""The model catalogue: the models of the applied deployment file, kept in SQL."""

from __future__ import annotations

import time

from gaas.settings.deployspec import DeploySpec, ModelSpec
from gaas.contracts.pricing import Price, price_for
from gaas.runtime.sql import Database

PRICES_SCHEMA = """
CREATE TABLE IF NOT EXISTS model_prices (
    model TEXT NOT NULL,
    tier TEXT NOT NULL,
    input DOUBLE PRECISION NOT NULL,
    cached_input DOUBLE PRECISION NOT NULL,
    output DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (model, tier)
)
"""
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
        await self._db.execute(PRICES_SCHEMA)

    async def apply(self, spec: DeploySpec) -> None:
        """Make the catalogue exactly the file's models (declarative: models not listed go away)."""
        now = int(time.time() * 1000)
        statements: list[tuple[str, tuple]] = [("DELETE FROM models", ()), ("DELETE FROM model_prices", ())]
        for m in spec.models:
            statements.append(
                (
                    "INSERT INTO models (name, version, source, preset, max_model_len, is_default, applied_ms)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (m.name, m.version, m.source, m.preset, m.max_model_len, int(m is spec.default_model), now),
                )
            )
            for tier in spec.prices:
                p = price_for(spec.prices, tier, m.name)
                statements.append((
                    "INSERT INTO model_prices (model, tier, input, cached_input, output) VALUES (?, ?, ?, ?, ?)",
                    (m.name, tier, p.input, p.cached_input, p.output),
                ))
        await self._db.transaction(statements)

    async def list(self) -> list[ModelSpec]:
        rows = await self._db.execute(
            "SELECT name, version, source, preset, max_model_len, is_default FROM models ORDER BY name"
        )
        return [ModelSpec(n, v, s, p, int(ml), bool(d)) for n, v, s, p, ml, d in rows]

    async def prices(self) -> dict[str, dict[str, Price]]:
        """model -> tier -> Price, as the applied file sets them."""
        out: dict[str, dict[str, Price]] = {}
        for model, tier, i, c, o in await self._db.execute(
            "SELECT model, tier, input, cached_input, output FROM model_prices ORDER BY model, tier"
        ):
            out.setdefault(model, {})[tier] = Price(float(i), float(c), float(o))
        return out
