"""Database URLs to run SQL-backed tests against: SQLite always, PostgreSQL when one answers."""

import os

import pytest

POSTGRES_URL = os.environ.get("GAAS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _postgres_answers() -> bool:
    try:
        import psycopg

        with psycopg.connect(POSTGRES_URL, connect_timeout=2):
            return True
    except Exception:
        return False


def database_urls(tmp_path_factory_name: str = "db"):
    return [
        pytest.param("sqlite", id="sqlite"),
        pytest.param(
            "postgresql",
            id="postgresql",
            marks=pytest.mark.skipif(not _postgres_answers(), reason=f"no PostgreSQL at {POSTGRES_URL}"),
        ),
    ]


def make_url(kind: str, tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'test.db'}" if kind == "sqlite" else POSTGRES_URL
