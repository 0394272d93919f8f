"""What must survive a controller restart, in SQLite in the data dir: one typed record per kind.

The applied revision (so a restart comes back on it without re-applying anything), the commit
held for confirmation, the last rejection, the last rewrite of history, the replica records,
operator node states, this controller's lease holder id, the replica generation counter, the
event log, and the usage ledger (tokens per tenant, key, model and minute, from every router).
Every kind has its own table or row and its own accessor here, and nowhere else knows a key: it
used to be one string-keyed JSON table whose keys were spread across four packages, with no
schema version.

``schema_version`` is kept in ``meta``. A data dir made by an older llmgw is migrated when opened
(v1, the key–value table, moves row by row into the typed tables in one transaction); one made by
a newer llmgw is refused rather than half-read.

One connection, used from one thread at a time behind a lock: SQLite serialises writers anyway,
and the controller writes a few rows a minute.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from llmgw.contract import USAGE_COUNTS, UsageBatch
from llmgw.decide.replica import Replica
from llmgw.errors import ConfigError
from llmgw.gitops.status import PendingPrune, Rejection, Rewrite
from llmgw.redact import redact

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sync (kind TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replicas (id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rollouts (model TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS node_states (node TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    subject TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (
    minute INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    model TEXT NOT NULL,
    requests INTEGER NOT NULL,
    errors INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    counted_from_stream INTEGER NOT NULL,
    PRIMARY KEY (minute, tenant, key, model)
);
CREATE TABLE IF NOT EXISTS usage_batches (instance TEXT PRIMARY KEY, seq INTEGER NOT NULL, time REAL NOT NULL);
"""
USAGE_GROUPS = ("tenant", "key", "model")
# Minutes older than this are summed into hours (a year of minutes per key and model is a lot
# of rows for a dashboard that shows hours).
USAGE_MINUTES_KEPT = 7 * 86400
# TOTAL, not SUM: SUM raises on a 64-bit overflow, and one bad router's rows would then fail every
# query of the ledger; a total is exact below 2**53 and saturates above.
_USAGE_SUMS = ", ".join(f"CAST(TOTAL({c}) AS INTEGER)" for c in USAGE_COUNTS)


class SyncKind(str, Enum):
    """The rows of the ``sync`` table: what the GitOps follower remembers."""

    APPLIED = "applied"
    PENDING = "pending"
    REJECTED = "rejected"
    JUDGED = "judged"
    REWRITE = "rewrite"


@dataclass(frozen=True)
class Applied:
    sha: str
    time: float
    source: str | None = None  # "<url> <branch>" it was followed from (None: written before this was kept)


@dataclass(frozen=True)
class Event:
    id: int
    time: float
    kind: str
    subject: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "kind": self.kind, "subject": self.subject, "message": self.message}


class Store:
    """The controller's durable state; ``path`` ":memory:" for tests that need none."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()
        self._reader: sqlite3.Connection | None = None

    # --- opening, and the schema ---------------------------------------------------------
    def open(self) -> Store:
        if self._db is None:
            if str(self.path) != ":memory:":
                # 0700: the database holds the fleet's events and state; on a machine that also
                # runs engines or other users, it is the controller's business only.
                Path(self.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                _upgrade(db, str(self.path))
            except BaseException:
                db.close()
                raise
            self._db = db
        return self

    def close(self) -> None:
        with self._read_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("Store.open() was not called")
        return self._db

    def _one(self, sql: str, args: tuple[Any, ...]) -> Any:
        with self._lock:
            row = self.db.execute(sql, args).fetchone()
        return row[0] if row else None

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self.db.execute(sql, args)

    def _meta(self, key: str) -> str | None:
        return self._one("SELECT value FROM meta WHERE key = ?", (key,))

    def _set_meta(self, key: str, value: str) -> None:
        self._write("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, value))

    # --- the GitOps follower's memory -------------------------------------------------------
    def _sync(self, kind: SyncKind) -> Any:
        raw = self._one("SELECT record FROM sync WHERE kind = ?", (kind.value,))
        return json.loads(raw) if raw is not None else None

    def _set_sync(self, kind: SyncKind, record: Any) -> None:
        """``record`` (JSON), or None to forget it."""
        if record is None:
            self._write("DELETE FROM sync WHERE kind = ?", (kind.value,))
        else:
            self._write("INSERT INTO sync(kind, record) VALUES(?, ?) "
                        "ON CONFLICT(kind) DO UPDATE SET record = excluded.record", (kind.value, json.dumps(record)))

    def applied(self) -> Applied | None:
        raw = self._sync(SyncKind.APPLIED)
        return Applied(raw["sha"], float(raw["time"]), raw.get("source")) if raw else None

    def set_applied(self, applied: Applied) -> None:
        self._set_sync(SyncKind.APPLIED, {"sha": applied.sha, "time": applied.time, "source": applied.source})

    def pending(self) -> PendingPrune | None:
        raw = self._sync(SyncKind.PENDING)
        return PendingPrune.from_json(raw) if raw else None

    def set_pending(self, pending: PendingPrune | None) -> None:
        self._set_sync(SyncKind.PENDING, pending.to_json() if pending else None)

    def rejected(self) -> Rejection | None:
        raw = self._sync(SyncKind.REJECTED)
        return Rejection.from_json(raw) if raw else None

    def set_rejected(self, rejection: Rejection | None) -> None:
        self._set_sync(SyncKind.REJECTED, rejection.to_json() if rejection else None)

    def judged(self) -> str | None:
        """The head last judged, so a bad commit is judged (and reported) once."""
        raw = self._sync(SyncKind.JUDGED)
        return str(raw) if raw else None

    def set_judged(self, sha: str | None) -> None:
        self._set_sync(SyncKind.JUDGED, sha)

    def rewrite(self) -> Rewrite | None:
        raw = self._sync(SyncKind.REWRITE)
        return Rewrite.from_json(raw) if raw else None

    def set_rewrite(self, rewrite: Rewrite | None) -> None:
        self._set_sync(SyncKind.REWRITE, rewrite.to_json() if rewrite else None)

    # --- the reconciler's memory ------------------------------------------------------------
    def replicas(self) -> list[Replica]:
        with self._lock:
            rows = self.db.execute("SELECT record FROM replicas ORDER BY id").fetchall()
        return [Replica.from_json(json.loads(r[0])) for r in rows]

    def save_replicas(self, replicas: Iterable[Replica]) -> None:
        """The replica records, replacing all there were, in one transaction."""
        rows = [(r.id, json.dumps(r.to_json())) for r in replicas]
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.execute("DELETE FROM replicas")
                self.db.executemany("INSERT INTO replicas(id, record) VALUES(?, ?)", rows)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    def rollout_records(self) -> dict[str, dict[str, Any]]:
        """Per model: the spec its stable replicas serve and its rollout (llmgw.reconciler.rollouts)."""
        with self._lock:
            rows = self.db.execute("SELECT model, record FROM rollouts").fetchall()
        out = {}
        for m, r in rows:
            try:
                out[m] = json.loads(r)
            except ValueError:
                # One torn or hand-edited row must not stop the controller: that model is taken as
                # serving what the catalog says, as on a first start.
                log.warning("rollout record of %s is not JSON; ignored", m)
        return out

    def save_rollout_records(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        """The rollout records, replacing all there were, in one transaction."""
        rows = [(m, json.dumps(r)) for m, r in records.items()]
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.execute("DELETE FROM rollouts")
                self.db.executemany("INSERT INTO rollouts(model, record) VALUES(?, ?)", rows)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    def generation(self) -> int:
        """The highest replica generation issued so far (0: none yet)."""
        value = self._meta("generation")
        return int(value) if value is not None else 0

    def next_generation(self, *, above: int = 0) -> int:
        """The next replica generation: generations only grow, which makes replica ids unique.

        ``above``: the highest generation in use by engines this controller did not number (adopted
        from another controller or an older copy of this data dir); the counter moves past it, so no
        new replica takes an adopted one's id."""
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                row = self.db.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
                generation = max(int(row[0]) if row else 0, above) + 1
                self.db.execute("INSERT INTO meta(key, value) VALUES('generation', ?) "
                                "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (str(generation),))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        return generation

    # --- operators' decisions and this controller's name ------------------------------------------
    def node_states(self) -> dict[str, str]:
        with self._lock:
            return dict(self.db.execute("SELECT node, state FROM node_states").fetchall())

    def set_node_state(self, node: str, state: str | None) -> None:
        """An operator state (cordoned, draining), or None for ready."""
        if state is None:
            self._write("DELETE FROM node_states WHERE node = ?", (node,))
        else:
            self._write("INSERT INTO node_states(node, state) VALUES(?, ?) "
                        "ON CONFLICT(node) DO UPDATE SET state = excluded.state", (node, state))

    def controller_id(self) -> str | None:
        return self._meta("controller_id")

    def set_controller_id(self, cid: str) -> None:
        self._set_meta("controller_id", cid)

    # --- the event log -----------------------------------------------------------------
    def add_event(self, kind: str, subject: str, message: str, *, now: float | None = None) -> Event:
        """Stored redacted (llmgw.redact): an event quoting a URL with a credential in it (git's
        error, a repository URL) must not keep the credential in the data dir."""
        t = time.time() if now is None else now
        subject, message = redact(subject), redact(message)
        with self._lock:
            cur = self.db.execute(
                "INSERT INTO events(time, kind, subject, message) VALUES(?, ?, ?, ?)", (t, kind, subject, message)
            )
        return Event(int(cur.lastrowid or 0), t, kind, subject, message)

    def events(self, *, after: int = 0, limit: int = 200) -> list[Event]:
        """Events with id > ``after``, oldest first, at most ``limit`` (the newest ones when cut)."""
        with self._lock:
            rows = self.db.execute(
                "SELECT id, time, kind, subject, message FROM events WHERE id > ? ORDER BY id DESC LIMIT ?",
                (after, limit),
            ).fetchall()
        # Redacted again as read: rows an earlier version stored whole are shown without it too.
        return [Event(i, t, kind, redact(subject), redact(message)) for i, t, kind, subject, message in reversed(rows)]


    # --- the usage ledger -----------------------------------------------------------------
    def record_usage(self, batch: UsageBatch, *, now: float | None = None) -> bool:
        """Add ``batch``'s rows unless this (instance, seq) was recorded before: one transaction
        for the rows and the seq, so a crash between them cannot count a resent batch twice."""
        t = time.time() if now is None else now
        upsert = (f"INSERT INTO usage(minute, tenant, key, model, {', '.join(USAGE_COUNTS)}) "
                  f"VALUES(?, ?, ?, ?, {', '.join('?' * len(USAGE_COUNTS))}) "
                  "ON CONFLICT(minute, tenant, key, model) DO UPDATE SET "
                  + ", ".join(f"{c} = {c} + excluded.{c}" for c in USAGE_COUNTS))
        rows = [(r.minute, r.tenant, r.key, r.model, *(getattr(r, c) for c in USAGE_COUNTS)) for r in batch.rows]
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                last = self.db.execute("SELECT seq FROM usage_batches WHERE instance = ?", (batch.instance,)).fetchone()
                if last is not None and batch.seq <= last[0]:
                    self.db.execute("COMMIT")
                    return False
                self.db.executemany(upsert, rows)
                self.db.execute("INSERT INTO usage_batches(instance, seq, time) VALUES(?, ?, ?) ON CONFLICT(instance) "
                                "DO UPDATE SET seq = excluded.seq, time = excluded.time",
                                (batch.instance, batch.seq, t))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        return True

    def usage(self, since: float, until: float, *, by: tuple[str, ...] = USAGE_GROUPS, step: int = 0,
              where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Sums over minutes in [since, until), grouped by ``by`` (of tenant, key, model) and, with
        ``step`` seconds, by time (each row's ``time`` is its step's start)."""
        if not set(by) <= set(USAGE_GROUPS) or not set(where or {}) <= set(USAGE_GROUPS):
            raise ValueError(f"usage is grouped and filtered by {', '.join(USAGE_GROUPS)} only")
        # Only names from USAGE_GROUPS and a whole number reach the SQL text; values are bound.
        groups = ([f"(minute / {int(step)}) * {int(step)}"] if step > 0 else []) + list(by)
        filters = "".join(f" AND {c} = ?" for c in (where or {}))
        sql = (f"SELECT {', '.join(groups + [_USAGE_SUMS])}, COUNT(*) FROM usage WHERE minute >= ? AND minute < ?"
               f"{filters}" + (f" GROUP BY {', '.join(groups)} ORDER BY {', '.join(groups)}" if groups else ""))
        db, lock = self._reader_for_queries()
        with lock:
            rows = db.execute(sql, (int(since), int(until), *(where or {}).values())).fetchall()
        names = (["time"] if step > 0 else []) + list(by) + list(USAGE_COUNTS)
        return [dict(zip(names, r[:-1], strict=True)) for r in rows if r[-1]]  # no rows: no sums

    def _reader_for_queries(self) -> tuple[sqlite3.Connection, threading.Lock]:
        """A connection of its own for the ledger's queries (WAL lets it read while the main one
        writes): a year of rows summed in a thread must not hold the lock that routers' reports,
        recorded on the event loop, wait for. ":memory:" has one connection only."""
        if str(self.path) == ":memory:":
            return self.db, self._lock
        with self._read_lock:
            if self._reader is None:
                self.db  # noqa: B018 - opened first (the schema is the main connection's to upgrade)
                self._reader = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            return self._reader, self._read_lock

    def compact_usage(self, *, now: float | None = None) -> int:
        """Sum minutes older than USAGE_MINUTES_KEPT into their hours (returns how many minutes not
        starting an hour were folded in). The batches' seqs are kept
        (one row per router process ever): forgetting one would count its resent batch again."""
        cutoff = int((time.time() if now is None else now) - USAGE_MINUTES_KEPT) // 3600 * 3600
        cols = ", ".join(USAGE_COUNTS)
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                old = self.db.execute("SELECT COUNT(*) FROM usage WHERE minute < ? AND minute % 3600 != 0",
                                      (cutoff,)).fetchone()[0]
                if old:
                    self.db.execute("CREATE TEMP TABLE hours AS SELECT minute / 3600 * 3600 AS minute, tenant, key, "
                                    f"model, {_USAGE_SUMS} FROM usage "
                                    "WHERE minute < ? GROUP BY 1, tenant, key, model", (cutoff,))
                    self.db.execute("DELETE FROM usage WHERE minute < ?", (cutoff,))
                    self.db.execute(f"INSERT INTO usage(minute, tenant, key, model, {cols}) SELECT * FROM hours")
                    self.db.execute("DROP TABLE hours")
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        return int(old)


def _version(db: sqlite3.Connection) -> int:
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" in tables:
        row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is not None:
            return int(row[0])
    return 1 if "kv" in tables else 0


def _upgrade(db: sqlite3.Connection, where: str) -> None:
    """Bring the database to SCHEMA_VERSION, in one transaction; refuse one from a newer llmgw."""
    version = _version(db)
    if version > SCHEMA_VERSION:
        raise ConfigError(f"{where}: made by a newer llmgw (state schema {version}; this one reads up to "
                          f"{SCHEMA_VERSION}); run that version, or start from a fresh data dir")
    if version == SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        # Again under the write lock: another process may have migrated it since the first look.
        version = _version(db)
        if version >= SCHEMA_VERSION:
            db.execute("COMMIT")
            return
        for statement in SCHEMA.strip().split(";"):
            if statement.strip():
                db.execute(statement)
        if version == 1:
            _migrate_v1(db)
        db.execute("INSERT INTO meta(key, value) VALUES('schema_version', ?) "
                   "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    if version == 1:
        log.info("%s: state migrated from schema 1 to %d", where, SCHEMA_VERSION)


def _migrate_v1(db: sqlite3.Connection) -> None:
    """v1: one ``kv`` table of JSON values. Each key moves to its typed home; the events stay."""
    rows = dict(db.execute("SELECT key, value FROM kv").fetchall())
    for key, raw in rows.items():
        value = json.loads(raw)
        if key in {k.value for k in SyncKind}:
            if value is not None:
                db.execute("INSERT OR REPLACE INTO sync(kind, record) VALUES(?, ?)", (key, json.dumps(value)))
        elif key == "replicas":
            db.executemany("INSERT OR REPLACE INTO replicas(id, record) VALUES(?, ?)",
                           [(r["id"], json.dumps(r)) for r in value or ()])
        elif key == "node_states":
            db.executemany("INSERT OR REPLACE INTO node_states(node, state) VALUES(?, ?)",
                           list((value or {}).items()))
        elif key in ("generation", "controller_id"):
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, str(value)))
        else:  # nothing else was ever written; kept readable rather than dropped
            log.warning("state migration: unknown v1 key %r kept in meta as legacy.%s", key, key)
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (f"legacy.{key}", raw))
    db.execute("DROP TABLE kv")
