"""The usage ledger: one row per request, keyed by GaaS's request id, so a usage event delivered
twice (a consumer that died before acknowledging, a spool replayed) is written once. Costs are
integers in micro-dollars, so every sum is exact. Also the tenants' budgets (durable here, mirrored
into Redis for the routers) and events that could not be read (kept aside, never dropped).
SQL through the shared layer: SQLite by default, PostgreSQL by URL; versioned migrations."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gaas.contracts import usage as metering
from gaas.contracts.usage import UsageEvent
from gaas.runtime.migrations import migrate
from gaas.runtime.sql import Database

MIGRATIONS: list[list[str]] = [
    # 1: the ledger as the first billing service kept it.
    [
        """CREATE TABLE IF NOT EXISTS usage_ledger (
            request_id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            model TEXT NOT NULL,
            model_version TEXT NOT NULL,
            prompt_tokens BIGINT NOT NULL,
            cached_tokens BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL,
            finished_ms BIGINT NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS usage_ledger_tenant_time ON usage_ledger (tenant, finished_ms)",
    ],
    # 2: what a usage event carries besides tokens: key, tier, costs, outcome, timings.
    [
        "ALTER TABLE usage_ledger ADD COLUMN key_id TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE usage_ledger ADD COLUMN tier TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE usage_ledger ADD COLUMN cost_input_micros BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE usage_ledger ADD COLUMN cost_cached_micros BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE usage_ledger ADD COLUMN cost_output_micros BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE usage_ledger ADD COLUMN outcome TEXT NOT NULL DEFAULT 'finished'",
        "ALTER TABLE usage_ledger ADD COLUMN worker TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE usage_ledger ADD COLUMN queue_ms DOUBLE PRECISION NOT NULL DEFAULT 0",
        "ALTER TABLE usage_ledger ADD COLUMN ttft_ms DOUBLE PRECISION NOT NULL DEFAULT 0",
        "ALTER TABLE usage_ledger ADD COLUMN e2e_ms DOUBLE PRECISION NOT NULL DEFAULT 0",
        "ALTER TABLE usage_ledger ADD COLUMN client_request_id TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE usage_ledger ADD COLUMN recorded_ms BIGINT NOT NULL DEFAULT 0",
        # The Stripe batch a row was reported in (NULL: not yet).
        "ALTER TABLE usage_ledger ADD COLUMN stripe_batch TEXT",
        "CREATE INDEX IF NOT EXISTS usage_ledger_unreported ON usage_ledger (stripe_batch, finished_ms)",
    ],
    # 3: budgets, events kept aside, and the Stripe outbox.
    [
        """CREATE TABLE IF NOT EXISTS budgets (
            tenant TEXT PRIMARY KEY,
            micros BIGINT NOT NULL,
            updated_ms BIGINT NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS dead_letters (
            entry_id TEXT PRIMARY KEY,
            raw TEXT NOT NULL,
            error TEXT NOT NULL,
            received_ms BIGINT NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS stripe_outbox (
            identifier TEXT PRIMARY KEY,
            batch TEXT NOT NULL,
            tenant TEXT NOT NULL,
            customer TEXT NOT NULL,
            event_name TEXT NOT NULL,
            window_start_ms BIGINT NOT NULL,
            value BIGINT NOT NULL,
            state TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            next_attempt_ms BIGINT NOT NULL DEFAULT 0,
            first_attempt_ms BIGINT NOT NULL DEFAULT 0,
            sent_ms BIGINT NOT NULL DEFAULT 0,
            last_error TEXT NOT NULL DEFAULT ''
        )""",
        "CREATE INDEX IF NOT EXISTS stripe_outbox_due ON stripe_outbox (state, next_attempt_ms)",
    ],
    # 4: the session a request was a turn of.
    [
        "ALTER TABLE usage_ledger ADD COLUMN session_id TEXT NOT NULL DEFAULT ''",
    ],
    # 5: the LoRA adapter a request was served with.
    [
        "ALTER TABLE usage_ledger ADD COLUMN adapter TEXT NOT NULL DEFAULT ''",
    ],
]

COLUMNS = (
    "request_id", "tenant", "key_id", "tier", "model", "model_version", "prompt_tokens", "cached_tokens",
    "completion_tokens", "cost_input_micros", "cost_cached_micros", "cost_output_micros", "outcome", "worker",
    "finished_ms", "queue_ms", "ttft_ms", "e2e_ms", "client_request_id", "recorded_ms", "session_id",
    "adapter",
)
# The SQL of each of gaas.contracts.usage.USAGE_GROUPS ("": the total).
GROUPS = {"": "''", "model": "model", "version": "model || ' ' || model_version", "key": "key_id",
          "day": "finished_ms / 86400000",
          "adapter": "CASE WHEN adapter = '' THEN model ELSE model || ':' || adapter END"}
assert set(GROUPS) == {"", *metering.USAGE_GROUPS}
# The requests among rows (a supplement bills more of a request: gaas.metering.admission.supplement).
REQUESTS = f"COUNT(*) - COUNT(CASE WHEN outcome = '{metering.SUPPLEMENT}' THEN 1 END)"


@dataclass(frozen=True, slots=True)
class UsageRow:
    group: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: int
    # Distinct sessions the requests were turns of.
    sessions: int = 0


class Ledger:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def init_schema(self) -> None:
        await migrate(self.db, "billing", MIGRATIONS)

    async def record(self, events: Sequence[UsageEvent]) -> int:
        """Write the events' rows, each request once however often it arrives; returns how many
        were new."""
        if not events:
            return 0
        now = int(time.time() * 1000)
        unique = {e.request_id: e for e in events}
        rows = [
            (e.request_id, e.tenant, e.key_id, e.tier, e.model, e.model_version, e.prompt_tokens, e.cached_tokens,
             e.completion_tokens, e.cost_input_micros, e.cost_cached_micros, e.cost_output_micros, e.outcome,
             e.worker, e.finished_ms, e.queue_ms, e.ttft_ms, e.e2e_ms, e.client_request_id, now, e.session_id,
             e.adapter)
            for e in unique.values()
        ]
        return await self.db.insert_new("usage_ledger", COLUMNS, rows, "request_id")

    async def usage(self, tenant: str, start_ms: int = 0, end_ms: int = 0, group_by: str = "") -> list[UsageRow]:
        """Sums of the tenant's rows with start_ms <= finished_ms < end_ms (0: open end), grouped."""
        group = GROUPS[group_by]
        query = (
            f"SELECT {group}, {REQUESTS}, COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0),"
            " COALESCE(SUM(completion_tokens), 0),"
            " COALESCE(SUM(cost_input_micros + cost_cached_micros + cost_output_micros), 0),"
            " COUNT(DISTINCT NULLIF(session_id, ''))"
            " FROM usage_ledger WHERE tenant = ? AND finished_ms >= ?"
        )
        params: list = [tenant, start_ms]
        if end_ms:
            query += " AND finished_ms < ?"
            params.append(end_ms)
        if group_by:
            query += f" GROUP BY {group} ORDER BY {group}"
        rows = await self.db.execute(query, params)
        if not group_by and rows and not rows[0][1]:
            return []  # no rows: no total either
        return [UsageRow(_group_name(group_by, g), int(n), int(p), int(c), int(o), int(cost), int(s))
                for g, n, p, c, o, cost, s in rows]

    async def totals(self, tenant: str, start_ms: int = 0, end_ms: int = 0) -> UsageRow:
        rows = await self.usage(tenant, start_ms, end_ms)
        return rows[0] if rows else UsageRow("", 0, 0, 0, 0, 0)

    async def invoice_lines(self, tenant: str, start_ms: int, end_ms: int) -> list[tuple[str, int, int, int, int, int, int, int]]:
        """Per model (and LoRA adapter: "model:adapter", priced apart): (model, requests, uncached prompt
        tokens, cached tokens, output tokens, and their costs)."""
        by = GROUPS["adapter"]
        rows = await self.db.execute(
            f"SELECT {by}, {REQUESTS}, COALESCE(SUM(prompt_tokens - cached_tokens), 0), COALESCE(SUM(cached_tokens), 0),"
            " COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cost_input_micros), 0),"
            " COALESCE(SUM(cost_cached_micros), 0), COALESCE(SUM(cost_output_micros), 0)"
            f" FROM usage_ledger WHERE tenant = ? AND finished_ms >= ? AND finished_ms < ? GROUP BY {by} ORDER BY {by}",
            (tenant, start_ms, end_ms),
        )
        return [tuple(int(v) if i else v for i, v in enumerate(r)) for r in rows]

    async def rows(self) -> int:
        return int((await self.db.execute("SELECT COUNT(*) FROM usage_ledger"))[0][0])

    # ------------------------------------------------------------ budgets

    async def set_budget(self, tenant: str, micros: int) -> None:
        now = int(time.time() * 1000)
        await self.db.transaction([
            ("DELETE FROM budgets WHERE tenant = ?", (tenant,)),
            *([("INSERT INTO budgets (tenant, micros, updated_ms) VALUES (?, ?, ?)", (tenant, micros, now))] if micros else []),
        ])

    async def budgets(self) -> dict[str, int]:
        return {t: int(m) for t, m in await self.db.execute("SELECT tenant, micros FROM budgets")}

    # ------------------------------------------------------------ events kept aside

    async def dead_letter(self, entry_id: str, raw: str, error: str) -> None:
        await self.db.execute(
            "INSERT INTO dead_letters (entry_id, raw, error, received_ms) VALUES (?, ?, ?, ?) ON CONFLICT (entry_id) DO NOTHING",
            (entry_id, raw, error, int(time.time() * 1000)),
        )

    async def dead_letters(self) -> int:
        return int((await self.db.execute("SELECT COUNT(*) FROM dead_letters"))[0][0])


def _group_name(group_by: str, value) -> str:
    if group_by == "day":
        return time.strftime("%Y-%m-%d", time.gmtime(int(value) * 86400))
    return "" if group_by == "" else str(value)
