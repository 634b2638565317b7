"""The usage ledger: one row per finished request, keyed by request id so a re-delivered usage
event is written once. Reads sum it per tenant and time range."""

from __future__ import annotations

from dataclasses import dataclass

from gaas.runtime.sql import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_ledger (
    request_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    model_version TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    finished_ms BIGINT NOT NULL
)
"""
INDEX = "CREATE INDEX IF NOT EXISTS usage_ledger_tenant_time ON usage_ledger (tenant, finished_ms)"


@dataclass(frozen=True, slots=True)
class UsageTotals:
    tenant: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Ledger:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def init_schema(self) -> None:
        await self._db.execute(SCHEMA)
        await self._db.execute(INDEX)

    async def totals(self, tenant: str, start_ms: int = 0, end_ms: int = 0) -> UsageTotals:
        """Sums of the tenant's rows with start_ms <= finished_ms < end_ms (0: open end)."""
        query = (
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0),"
            " COALESCE(SUM(completion_tokens), 0) FROM usage_ledger WHERE tenant = ? AND finished_ms >= ?"
        )
        params: list = [tenant, start_ms]
        if end_ms:
            query += " AND finished_ms < ?"
            params.append(end_ms)
        (n, p, c, g), = await self._db.execute(query, params)
        return UsageTotals(tenant, int(n), int(p), int(c), int(g))
