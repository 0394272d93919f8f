"""The store's suite runs every test against both implementations: ``backend`` is SQLite in a
temporary data dir or a fresh database on the session's real PostgreSQL server
(tests/fixtures/postgres.py), and ``backend.open()`` opens one more store on the same data, as
another controller (or the same one restarted) would."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.store.protocol import Store
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures for this package


class Backend:
    """One database, and every store opened on it (closed when the test ends)."""

    def __init__(self, kind: str, make: Callable[[], Store], sql: Callable[[str, tuple[Any, ...]], list[Any]]) -> None:
        self.kind = kind
        self._make = make
        self._sql = sql
        self.opened: list[Store] = []

    def store(self) -> Store:
        """A store on this database, not opened."""
        store = self._make()
        self.opened.append(store)
        return store

    def open(self) -> Store:
        return self.store().open()

    def sql(self, statement: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """A statement run on the database behind the store's back (``?`` marks its arguments)."""
        return self._sql(statement, args)

    def close(self) -> None:
        for store in self.opened:
            store.close()


def _sqlite_sql(path: Path) -> Callable[[str, tuple[Any, ...]], list[Any]]:
    def run(statement: str, args: tuple[Any, ...]) -> list[Any]:
        db = sqlite3.connect(path, isolation_level=None)
        try:
            return db.execute(statement, args).fetchall()
        finally:
            db.close()
    return run


def _postgres_sql(url: str) -> Callable[[str, tuple[Any, ...]], list[Any]]:
    import psycopg

    def run(statement: str, args: tuple[Any, ...]) -> list[Any]:
        with psycopg.connect(url, autocommit=True) as conn:
            cur = conn.execute(statement.replace("?", "%s"), args)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description else []
    return run


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        from llmgw.store.sqlite import SqliteStore

        path = tmp_path / "data" / "llmgw.db"
        made = Backend("sqlite", lambda: SqliteStore(path), _sqlite_sql(path))
    else:
        from llmgw.store.postgres import PostgresStore

        url = request.getfixturevalue("postgres_url")
        made = Backend("postgresql", lambda: PostgresStore(url), _postgres_sql(url))
    yield made
    made.close()


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.open()
