"""Schemas: an empty store is brought to the current schema, a data dir of the previous SQLite
schema keeps every record and gains the lease, a store made by a newer llmgw is refused (and
PostgreSQL's are the same for controllers starting together)."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from llmgw.errors import ConfigError
from llmgw.store import postgres as pg
from llmgw.store.sqlite import SCHEMA_VERSION as SQLITE_VERSION
from llmgw.store.sqlite import SqliteStore
from tests.store.conftest import Backend
from tests.store.test_records import PENDING, REJECTION, REWRITE, assert_everything, replica

# Schema 4, as llmgw wrote it before the lease (llmgw/state.py at 2d14b93).
V4 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE sync (kind TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE replicas (id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE rollouts (model TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE node_states (node TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, kind TEXT NOT NULL,
                     subject TEXT NOT NULL, message TEXT NOT NULL);
CREATE TABLE usage (minute INTEGER NOT NULL, tenant TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,
                    requests INTEGER NOT NULL, errors INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
                    completion_tokens INTEGER NOT NULL, counted_from_stream INTEGER NOT NULL,
                    PRIMARY KEY (minute, tenant, key, model));
CREATE TABLE usage_batches (instance TEXT PRIMARY KEY, seq INTEGER NOT NULL, time REAL NOT NULL);
"""


def schema_version(backend: Backend) -> int:
    return int(backend.sql("SELECT value FROM meta WHERE key = 'schema_version'")[0][0])


def current(backend: Backend) -> int:
    return SQLITE_VERSION if backend.kind == "sqlite" else pg.SCHEMA_VERSION


def test_an_empty_store_gets_the_current_schema_once(backend: Backend) -> None:
    backend.open()
    assert schema_version(backend) == current(backend)
    again = backend.open()  # nothing left to do
    assert schema_version(backend) == current(backend) and again.leadership().epoch == 0


def test_controllers_opening_a_new_store_together_all_start(backend: Backend) -> None:
    stores = [backend.store() for _ in range(4)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(stores))

    def open_it(store: object) -> None:
        start.wait(timeout=30)
        try:
            store.open()  # type: ignore[attr-defined]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_it, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and schema_version(backend) == current(backend)
    assert stores[0].next_generation() == 1 and stores[3].next_generation() == 2


def test_a_store_from_a_newer_llmgw_is_refused_not_half_read(backend: Backend) -> None:
    backend.open().close()
    backend.sql("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(current(backend) + 1),))
    with pytest.raises(ConfigError, match=f"made by a newer llmgw \\(\\w+ schema {current(backend) + 1}"):
        backend.open()


def test_the_previous_sqlite_schema_keeps_every_record_and_gains_the_lease(tmp_path: Path) -> None:
    path = tmp_path / "llmgw.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(V4)
    rows = {
        "meta": [("schema_version", "4"), ("generation", "7"), ("controller_id", "ctl-a-1234")],
        "sync": [("applied", json.dumps({"sha": "a" * 40, "time": 12.5,
                                         "source": "https://git.example.com/catalog.git main"})),
                 ("pending", json.dumps(PENDING.to_json())), ("rejected", json.dumps(REJECTION.to_json())),
                 ("judged", json.dumps("d" * 40)), ("rewrite", json.dumps(REWRITE.to_json()))],
        "replicas": [(r.id, json.dumps(r.to_json())) for r in (replica("chat-g1"),
                                                               replica("chat-g2", generation=2, nodes=("n1", "n2")))],
        "rollouts": [("chat", json.dumps({"stable": {"fingerprint": "f" * 16},
                                          "rollout": {"phase": "canary", "weight": 0.25}}))],
        "node_states": [("n1", "cordoned"), ("n2", "draining")],
        "usage_batches": [("router-1", 5, 100.0)],
        "usage": [(60, "t", "k", "m", 1, 0, 10, 20, 0)],
    }
    for table, values in rows.items():
        db.executemany(f"INSERT INTO {table} VALUES({', '.join('?' * len(values[0]))})", values)
    db.execute("INSERT INTO events(time, kind, subject, message) VALUES(1.0, 'k', 's', 'm')")
    db.close()

    store = SqliteStore(path).open()
    try:
        assert_everything(store)
        assert [e.message for e in store.events()] == ["m"]
        assert store.usage(0, 2 ** 40, by=())[0]["prompt_tokens"] == 10
        from llmgw.contract import UsageBatch, UsageRow

        assert store.record_usage(UsageBatch("router-1", 5, ())) is False  # its seq was kept
        # The ledger gained refusals (schema 8): none in the old rows, counted in new ones.
        assert store.usage(0, 2 ** 40, by=())[0]["refused"] == 0
        assert store.record_usage(UsageBatch("router-1", 6, (UsageRow(60, "t", "k", "m", refused=3),)))
        assert store.usage(0, 2 ** 40, by=())[0]["refused"] == 3
        grant = store.acquire_lease("ctl-a", ttl=60)
        assert grant is not None and grant.epoch == 1
    finally:
        store.close()
    version = sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert version == (str(SQLITE_VERSION),)


def test_a_postgresql_store_is_migrated_step_by_step_keeping_its_rows(postgres_url: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What the next schema change will do: a store at schema 1 brought to 2 in one transaction."""
    first = pg.PostgresStore(postgres_url).open()
    first.set_node_state("n1", "cordoned")
    first.close()
    monkeypatch.setattr(pg, "MIGRATIONS", (*pg.MIGRATIONS, "ALTER TABLE node_states ADD COLUMN why TEXT;"))
    monkeypatch.setattr(pg, "SCHEMA_VERSION", len(pg.MIGRATIONS))
    second = pg.PostgresStore(postgres_url).open()
    try:
        assert second.node_states() == {"n1": "cordoned"}
        assert second._one("SELECT value FROM meta WHERE key = 'schema_version'", ()) == str(pg.SCHEMA_VERSION)
        assert second._one("SELECT count(*) FROM information_schema.columns WHERE column_name = 'why'", ()) == 1
    finally:
        second.close()
