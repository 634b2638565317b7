"""A small SQL layer over SQLite (default) and PostgreSQL (GAAS_DATABASE_URL=postgresql://...).

Both speak DB-API; queries are written with '?' placeholders and translated for psycopg. Calls
run in a worker thread so they never block a service's event loop.

PostgreSQL: every statement is bounded (statement_timeout), and a connection that was lost (a
restarted server) is replaced at the next call; the call that found it lost fails with
errors.Unavailable (it is not retried: it may have been a write whose commit nobody saw).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from gaas.contracts import errors

T = TypeVar("T")


class Database:
    """One connection guarded by a lock; plenty for the control plane's and billing's rates."""

    def __init__(self, url: str, statement_timeout_seconds: float = 30.0) -> None:
        self.url = url
        self._statement_timeout_ms = int(statement_timeout_seconds * 1000)
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

            self._lost_errors: tuple[type[BaseException], ...] = (psycopg.OperationalError,)
            self.dialect = "postgresql"
            self._conn = self._connect_postgres()
        else:
            raise ValueError(f"unsupported database URL {url!r}: use sqlite:///path.db or postgresql://...")

    def _connect_postgres(self):
        import psycopg

        return psycopg.connect(self.url, autocommit=True, connect_timeout=10,
                               options=f"-c statement_timeout={self._statement_timeout_ms}")

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """The connection, under the lock; a PostgreSQL one that was lost is replaced first, and
        losing it during the call is errors.Unavailable."""
        with self._lock:
            if self.dialect != "postgresql":
                yield self._conn
                return
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = self._connect_postgres()
                yield self._conn
            except self._lost_errors as exc:
                if self._conn is not None and (self._conn.closed or self._conn.broken):
                    self._conn.close()
                    self._conn = None
                raise errors.Unavailable(
                    f"the database did not answer ({type(exc).__name__}); retry shortly") from exc

    def _sql(self, query: str) -> str:
        return query.replace("?", "%s") if self.dialect == "postgresql" else query

    def execute_sync(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._connection() as conn:
            cur = conn.execute(self._sql(query), tuple(params))
            rows = cur.fetchall() if cur.description else []
            return [tuple(r) for r in rows]

    def transaction_sync(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        """Run statements atomically."""
        with self._connection() as conn:
            if self.dialect == "sqlite":
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for q, p in statements:
                        conn.execute(q, tuple(p))
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            else:
                with conn.transaction():
                    for q, p in statements:
                        conn.execute(self._sql(q), tuple(p))

    def run_sync(self, fn: Callable[[Callable[..., list[tuple]]], T]) -> T:
        """fn(execute) inside one transaction (execute(query, params) -> rows); its result."""

        with self._connection() as conn:
            def execute(query: str, params: Sequence[Any] = ()) -> list[tuple]:
                cur = conn.execute(self._sql(query), tuple(params))
                return [tuple(r) for r in cur.fetchall()] if cur.description else []

            if self.dialect == "sqlite":
                conn.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(execute)
                    conn.execute("COMMIT")
                    return result
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            with conn.transaction():
                return fn(execute)

    def insert_new_sync(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], key: str) -> int:
        """Insert the rows whose key is not in the table yet, atomically; returns how many were new.
        PostgreSQL: COPY into a temporary table, then one INSERT ... SELECT (several times faster
        than a many-row INSERT); SQLite: many-row INSERTs. Rows repeating a key within the call:
        the first wins."""
        if not rows:
            return 0
        cols = ", ".join(columns)
        with self._connection() as conn:
            if self.dialect == "sqlite":
                new = 0
                conn.execute("BEGIN IMMEDIATE")
                try:
                    per = max(1, 30000 // len(columns))  # under SQLite's limit of bound parameters
                    row_marks = "(" + ", ".join("?" * len(columns)) + ")"
                    for start in range(0, len(rows), per):
                        chunk = rows[start:start + per]
                        cur = conn.execute(
                            f"INSERT INTO {table} ({cols}) VALUES {', '.join([row_marks] * len(chunk))}"
                            f" ON CONFLICT ({key}) DO NOTHING", [v for row in chunk for v in row],
                        )
                        new += cur.rowcount
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                return new
            staging = f"{table}_incoming"
            with conn.transaction():
                conn.execute(
                    f"CREATE TEMP TABLE IF NOT EXISTS {staging} (LIKE {table} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
                )
                with conn.cursor().copy(f"COPY {staging} ({cols}) FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
                cur = conn.execute(
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
            if self._conn is not None:
                self._conn.close()
