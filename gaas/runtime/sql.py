"""A small SQL layer over SQLite (default) and PostgreSQL (GAAS_DATABASE_URL=postgresql://...).

Both speak DB-API; queries are written with '?' placeholders and translated for psycopg. Calls
run in a worker thread so they never block a service's event loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


class Database:
    """One connection guarded by a lock; plenty for the control plane's and billing's rates."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        if url.startswith("sqlite:///"):
            # As SQLAlchemy spells it: sqlite:///relative.db, sqlite:////absolute.db, sqlite:///:memory:
            path = url[len("sqlite:///"):]
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self.dialect = "sqlite"
        elif url.startswith(("postgresql://", "postgres://")):
            import psycopg

            self._conn = psycopg.connect(url, autocommit=True, connect_timeout=10)
            self.dialect = "postgresql"
        else:
            raise ValueError(f"unsupported database URL {url!r}: use sqlite:///path.db or postgresql://...")

    def _sql(self, query: str) -> str:
        return query.replace("?", "%s") if self.dialect == "postgresql" else query

    def execute_sync(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            cur = self._conn.execute(self._sql(query), tuple(params))
            rows = cur.fetchall() if cur.description else []
            return [tuple(r) for r in rows]

    def transaction_sync(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        """Run statements atomically."""
        with self._lock:
            if self.dialect == "sqlite":
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    for q, p in statements:
                        self._conn.execute(q, tuple(p))
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
            else:
                with self._conn.transaction():
                    for q, p in statements:
                        self._conn.execute(self._sql(q), tuple(p))

    async def execute(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        return await asyncio.to_thread(self.execute_sync, query, params)

    async def transaction(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        await asyncio.to_thread(self.transaction_sync, list(statements))

    def close(self) -> None:
        with self._lock:
            self._conn.close()
