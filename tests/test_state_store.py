"""The SQLite store's own history: a data dir made by the first version (schema 1, the key–value
table; the fixture is a real one, made by `llmgw up` of that version, cordoned, with a rejected
commit, then killed with -9) keeps working, and one from a newer version is refused. What both
stores must do, against both, is in tests/store."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from llmgw.decide.replica import ReplicaState
from llmgw.errors import ConfigError
from llmgw.store.records import Applied, PendingPrune
from llmgw.store.sqlite import SCHEMA_VERSION
from llmgw.store.sqlite import SqliteStore as Store

V1 = Path(__file__).parent / "fixtures" / "data" / "v1-llmgw.db"


def test_a_v1_data_dir_is_migrated_with_everything_in_it(tmp_path: Path) -> None:
    path = tmp_path / "llmgw.db"
    shutil.copy(V1, path)
    before = dict(sqlite3.connect(path).execute("SELECT key, value FROM kv").fetchall())
    events_before = sqlite3.connect(path).execute("SELECT count(*) FROM events").fetchone()[0]
    store = Store(path).open()
    try:
        applied = store.applied()
        assert applied is not None and applied.sha == before["applied"].split('"sha": "')[1][:40]
        rejected = store.rejected()
        assert rejected is not None and rejected.subject == "A broken model" and rejected.problems
        assert store.judged() == rejected.sha
        assert store.node_states() == {"local": "cordoned"}
        replicas = store.replicas()
        assert [(r.id, r.state) for r in replicas] == [("sim-chat-g1", ReplicaState.READY),
                                                       ("sim-embed-g2", ReplicaState.READY)]
        assert all(r.shards[0].pid for r in replicas)
        assert store.controller_id() == before["controller_id"].strip('"')
        assert store.next_generation() == int(before["generation"]) + 1  # ids stay unique across the upgrade
        assert len(store.events(limit=1000)) == events_before
        assert store.pending() is None and store.rewrite() is None
    finally:
        store.close()
    db = sqlite3.connect(path)
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "kv" not in tables
    assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    # Opened again: nothing to migrate, the same state.
    again = Store(path).open()
    assert again.node_states() == {"local": "cordoned"} and len(again.replicas()) == 2
    again.close()


def test_records_round_trip_and_a_cleared_one_is_gone(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db").open()
    store.set_applied(Applied("a" * 40, 12.5))
    store.set_pending(PendingPrune("b" * 40, "Ann", "Remove all", ("removes 3 of 3 models",)))
    store.set_node_state("n1", "draining")
    store.set_node_state("n2", "cordoned")
    store.set_node_state("n2", None)
    assert store.applied() == Applied("a" * 40, 12.5)
    assert store.pending() == PendingPrune("b" * 40, "Ann", "Remove all", ("removes 3 of 3 models",))
    store.set_pending(None)
    assert store.pending() is None and store.node_states() == {"n1": "draining"}
    assert [store.next_generation() for _ in range(3)] == [1, 2, 3]
    store.close()


def test_a_data_dir_from_a_newer_version_is_refused_not_half_read(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    Store(path).open().close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    with pytest.raises(ConfigError, match=f"made by a newer llmgw \\(state schema {SCHEMA_VERSION + 1}"):
        Store(path).open()


def test_a_v2_data_dir_gains_the_usage_ledger_and_keeps_its_state(tmp_path: Path) -> None:
    """Schema 2 (before the ledger), written as that version did: opened, it gets the usage
    tables in the same transaction as the version bump, and its records are untouched."""
    path = tmp_path / "llmgw.db"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE sync (kind TEXT PRIMARY KEY, record TEXT NOT NULL);
        CREATE TABLE replicas (id TEXT PRIMARY KEY, record TEXT NOT NULL);
        CREATE TABLE node_states (node TEXT PRIMARY KEY, state TEXT NOT NULL);
        CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, kind TEXT NOT NULL,
                             subject TEXT NOT NULL, message TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '2'), ('generation', '7');
        INSERT INTO node_states VALUES ('n1', 'draining');
    """)
    db.commit()
    db.close()
    from llmgw.contract import UsageBatch, UsageRow

    store = Store(path).open()
    try:
        assert store.node_states() == {"n1": "draining"} and store.next_generation() == 8
        assert store.usage(0, 2 ** 40) == []
        assert store.record_usage(UsageBatch("r", 1, (UsageRow(60, "t", "k", "m", 1, 0, 2, 3, 0),)))
        assert store.usage(0, 2 ** 40)[0]["completion_tokens"] == 3
    finally:
        store.close()
    assert Store(path).open().rollout_records() == {}  # the rollouts table (v4) is there too
    version = sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert version == (str(SCHEMA_VERSION),)


def test_a_file_that_is_not_a_database_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "llmgw.db"
    path.write_bytes(b"this is not SQLite" * 100)
    with pytest.raises(ConfigError, match=f"{path}: cannot use the store: file is not a database"):
        Store(path).open()
