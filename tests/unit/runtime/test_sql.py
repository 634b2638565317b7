"""The SQL layer against a real PostgreSQL: a lost connection (a restarted server) fails the call
that found it with Unavailable and is replaced at the next; statements are bounded in time."""

import psycopg
import pytest

from gaas.contracts import errors
from gaas.runtime.sql import Database


def test_a_lost_connection_is_replaced_at_the_next_call(postgres_url):
    db = Database(postgres_url)
    try:
        (pid,), = db.execute_sync("SELECT pg_backend_pid()")
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))  # as a server restart would
        with pytest.raises(errors.Unavailable, match="the database did not answer"):
            db.execute_sync("SELECT 1")
        assert db.execute_sync("SELECT 1") == [(1,)]
        (new_pid,), = db.execute_sync("SELECT pg_backend_pid()")
        assert new_pid != pid
    finally:
        db.close()


def test_statements_are_bounded_in_time(postgres_url):
    db = Database(postgres_url, statement_timeout_seconds=0.2)
    try:
        with pytest.raises(errors.Unavailable):
            db.execute_sync("SELECT pg_sleep(2)")
        assert db.execute_sync("SELECT 1") == [(1,)]
    finally:
        db.close()
