"""A small SQL layer over SQLite (default) and PostgreSQL (GAAS_DATABASE_URL=postgresql://...).

Both speak DB-API; queries are written with '?' placeholders and translated for psycopg. Calls
run in a worker thread so they never block a service's event loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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

    def run_sync(self, fn: Callable[[Callable[..., list[tuple]]], T]) -> T:
        """fn(execute) inside one transaction (execute(query, params) -> rows); its result."""

        def execute(query: str, params: Sequence[Any] = ()) -> list[tuple]:
            cur = self._conn.execute(self._sql(query), tuple(params))
            return [tuple(r) for r in cur.fetchall()] if cur.description else []

        with self._lock:
            if self.dialect == "sqlite":
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(execute)
                    self._conn.execute("COMMIT")
                    return result
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
            with self._conn.transaction():
                return fn(execute)

    def insert_new_sync(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], key: str) -> int:
        """Insert the rows whose key is not in the table yet, atomically; returns how many were new.
        PostgreSQL: COPY into a temporary table, then one INSERT ... SELECT (several times faster
        than a many-row INSERT); SQLite: many-row INSERTs. Rows repeating a key within the call:
        the first wins."""
        if not rows:
            return 0
        cols = ", ".join(columns)
        with self._lock:
            if self.dialect == "sqlite":
                new = 0
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    per = max(1, 30000 // len(columns))  # under SQLite's limit of bound parameters
                    row_marks = "(" + ", ".join("?" * len(columns)) + ")"
                    for start in range(0, len(rows), per):
                        chunk = rows[start:start + per]
                        cur = self._conn.execute(
                            f"INSERT INTO {table} ({cols}) VALUES {', '.join([row_marks] * len(chunk))}"
                            f" ON CONFLICT ({key}) DO NOTHING", [v for row in chunk for v in row],
                        )
                        new += cur.rowcount
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                return new
            staging = f"{table}_incoming"
            with self._conn.transaction():
                self._conn.execute(
                    f"CREATE TEMP TABLE IF NOT EXISTS {staging} (LIKE {table} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
                )
                with self._conn.cursor().copy(f"COPY {staging} ({cols}) FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
                cur = self._conn.execute(
                    f"INSERT INTO {table} ({cols}) SELECT DISTINCT ON ({key}) {cols} FROM {staging}"
                    f" ON CONFLICT ({key}) DO NOTHING"
                )
                return cur.rowcount

    async def insert_new(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], key: str) -> int:
        return await asyncio.to_thread(self.insert_new_sync, table, columns, rows, key)

    async def run(self, fn: Callable[[Callable[..., list[tuple]]], T]) -> T:
        return await asyncio.to_thread(self.run_sync, fn)

    async def execute(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        return await asyncio.to_thread(self.execute_sync, query, params)

    async def transaction(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        await asyncio.to_thread(self.transaction_sync, list(statements))

    def close(self) -> None:
        with self._lock:
            self._conn.close()
