"""The controller's store in SQLite in the data dir: the embedded default (`llmgw up`, one controller).

The applied revision (so a restart comes back on it without re-applying anything), the commit
held for confirmation, the last rejection, the last rewrite of history, the replica records,
the rollouts, operator node states, this controller's lease holder id, the replica generation
counter, the event log, the usage ledger (tokens per tenant, key, model and minute, from every
router) with each router's last batch number, and the leader lease. Every kind has its own
table or row and its own accessor, and nowhere else knows a key: it used to be one string-keyed
JSON table whose keys were spread across four packages, with no schema version.

``schema_version`` is kept in ``meta``. A data dir made by an older llmgw is migrated when opened
(v1, the key–value table, moves row by row into the typed tables in one transaction; later ones
gain their new tables); one made by a newer llmgw is refused rather than half-read.

One connection, used from one thread at a time behind a lock: SQLite serialises writers anyway,
and the controller writes a few rows a minute. The lease is judged on this machine's clock as
SQLite reads it: with one controller per data dir it only ever meets itself.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from llmgw.contract import USAGE_COUNTS, UsageBatch
from llmgw.decide.replica import Replica
from llmgw.errors import ConfigError
from llmgw.redact import redact
from llmgw.store.audit import COLUMNS, GENESIS, AuditEntry, AuditRecord, automation_entry, from_row, redacted, row_hash
from llmgw.store.base import (
    FORGET_AFTER,
    LEASE_NAME,
    USAGE_MINUTES_KEPT,
    DatabaseError,
    JsonRecords,
    check_ttl,
    decode_rollouts,
    usage_query,
)
from llmgw.store.protocol import USAGE_GROUPS
from llmgw.store.records import ControllerSeen, Event, Leadership, LeaseGrant, SyncKind

log = logging.getLogger(__name__)

# 5: the leader lease; 6: the controllers' check-ins; 7: API keys made by `llmgw keys`; 8: usage counts
# refusals (a column: the only step that did not add a table)
SCHEMA_VERSION = 9
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
    refused INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, tenant, key, model)
);
CREATE TABLE IF NOT EXISTS usage_batches (instance TEXT PRIMARY KEY, seq INTEGER NOT NULL, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS lease (
    name TEXT PRIMARY KEY,
    holder TEXT,
    epoch INTEGER NOT NULL,
    expires REAL NOT NULL,
    taken REAL,
    renewed REAL
);
CREATE TABLE IF NOT EXISTS controllers (holder TEXT PRIMARY KEY, url TEXT, role TEXT NOT NULL, seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (name TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    who TEXT NOT NULL,
    role TEXT NOT NULL,
    source TEXT NOT NULL,
    action TEXT NOT NULL,
    result TEXT NOT NULL,
    revision TEXT NOT NULL,
    prev TEXT NOT NULL UNIQUE,  -- a second guard: two rows never follow one (a forked chain)
    hash TEXT NOT NULL
);
"""
# TOTAL, not SUM: SUM raises on a 64-bit overflow, and one bad router's rows would then fail every
# query of the ledger; a total is exact below 2**53 and saturates above.
_USAGE_SUMS = ", ".join(f"CAST(TOTAL({c}) AS INTEGER)" for c in USAGE_COUNTS)
# SQLite's own reading of the clock, in Unix seconds (julianday is exact to well under a millisecond).
_NOW = "SELECT (julianday('now') - 2440587.5) * 86400.0"


class SqliteStore(JsonRecords):
    """The controller's durable state in one SQLite file; ``path`` ":memory:" for tests that need none."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()
        self._reader: sqlite3.Connection | None = None

    @property
    def where(self) -> str:
        return str(self.path)

    # --- opening, and the schema ---------------------------------------------------------
    def open(self) -> Self:
        if self._db is None:
            if str(self.path) != ":memory:":
                # 0700: the database holds the fleet's events and state; on a machine that also
                # runs engines or other users, it is the controller's business only.
                Path(self.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._db = _opened(str(self.path))
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

    @contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        """The connection, for one thread at a time; SQLite's errors leave as StoreError."""
        with self._lock:
            try:
                yield self.db
            except DatabaseError:
                raise
            except sqlite3.Error as exc:
                raise DatabaseError(f"{self.path}: {exc}") from exc

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (taken at once, so nothing it read changes under it)."""
        with self._locked() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                if db.in_transaction:  # SQLite ends some on its own (a full disk)
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _one(self, sql: str, args: tuple[Any, ...]) -> Any:
        with self._locked() as db:
            row = db.execute(sql, args).fetchone()
        return row[0] if row else None

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._locked() as db:
            db.execute(sql, args)

    def _meta(self, key: str) -> str | None:
        return self._one("SELECT value FROM meta WHERE key = ?", (key,))

    def _set_meta(self, key: str, value: str) -> None:
        self._write("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, value))

    # --- the GitOps follower's memory (its records: llmgw.store.base.JsonRecords) ----------
    def _sync(self, kind: SyncKind) -> Any:
        raw = self._one("SELECT record FROM sync WHERE kind = ?", (kind.value,))
        return json.loads(raw) if raw is not None else None

    def _set_sync(self, kind: SyncKind, record: Any) -> None:
        if record is None:
            self._write("DELETE FROM sync WHERE kind = ?", (kind.value,))
        else:
            self._write("INSERT INTO sync(kind, record) VALUES(?, ?) "
                        "ON CONFLICT(kind) DO UPDATE SET record = excluded.record", (kind.value, json.dumps(record)))

    # --- API keys made by `llmgw keys` (hashes only) ------------------------------------------
    # --- the audit trail (append-only: no call here updates or deletes a row) -----------------
    def _audit_automation(self, event: Event) -> None:
        applied = self.applied()
        entry = automation_entry(event.kind, event.subject, event.message, event.time,
                                 applied.sha if applied is not None else "")
        if entry is not None:
            self.append_audit(entry)

    def append_audit(self, entry: AuditEntry) -> AuditRecord:
        """One row, chained to the last (in one write transaction: no two rows share a previous)."""
        entry = redacted(entry)
        with self._transaction() as db:
            last = db.execute("SELECT id, hash FROM audit ORDER BY id DESC LIMIT 1").fetchone()
            row_id, prev = (int(last[0]) + 1, str(last[1])) if last else (1, GENESIS)
            digest = row_hash(row_id, entry, prev)
            db.execute("INSERT INTO audit(id, time, who, role, source, action, result, revision, prev, hash) "
                       "VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (row_id, entry.time, entry.who, entry.role, entry.source, entry.action, entry.result,
                        entry.revision, prev, digest))
        return AuditRecord(row_id, entry, prev, digest)

    def audit(self, *, since: float = 0.0, after: int = 0, limit: int = 0, last: int = 0) -> list[AuditRecord]:
        """Rows from ``since`` and after id ``after``, oldest first (``limit`` 0: all of them;
        ``last``: only the newest that many)."""
        sql = f"SELECT {COLUMNS} FROM audit WHERE time >= ? AND id > ? ORDER BY id"
        if last > 0:
            sql = f"SELECT * FROM ({sql} DESC LIMIT {int(last)}) ORDER BY id"
        elif limit > 0:
            sql += f" LIMIT {int(limit)}"
        with self._locked() as db:
            rows = db.execute(sql, (since, after)).fetchall()
        return [from_row(r) for r in rows]

    def api_keys(self) -> list[dict[str, Any]]:
        with self._locked() as db:
            rows = db.execute("SELECT record FROM api_keys ORDER BY name").fetchall()
        return [json.loads(r[0]) for r in rows]

    def add_api_key(self, entry: Mapping[str, Any]) -> bool:
        with self._transaction() as db:
            cur = db.execute("INSERT INTO api_keys(name, record) VALUES(?, ?) ON CONFLICT(name) DO NOTHING",
                             (str(entry["name"]), json.dumps(dict(entry))))
            return cur.rowcount == 1

    def replace_api_key(self, name: str, entry: Mapping[str, Any]) -> bool:
        with self._transaction() as db:
            if db.execute("DELETE FROM api_keys WHERE name = ?", (name,)).rowcount != 1:
                return False
            db.execute("INSERT INTO api_keys(name, record) VALUES(?, ?)", (str(entry["name"]), json.dumps(dict(entry))))
            return True

    # --- the reconciler's memory ------------------------------------------------------------
    def replicas(self) -> list[Replica]:
        with self._locked() as db:
            rows = db.execute("SELECT record FROM replicas ORDER BY id").fetchall()
        return [Replica.from_json(json.loads(r[0])) for r in rows]

    def save_replicas(self, replicas: Iterable[Replica]) -> None:
        rows = [(r.id, json.dumps(r.to_json())) for r in replicas]
        with self._transaction() as db:
            db.execute("DELETE FROM replicas")
            db.executemany("INSERT INTO replicas(id, record) VALUES(?, ?)", rows)

    def rollout_records(self) -> dict[str, dict[str, Any]]:
        with self._locked() as db:
            rows = db.execute("SELECT model, record FROM rollouts").fetchall()
        return decode_rollouts(rows, log)

    def save_rollout_records(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        rows = [(m, json.dumps(r)) for m, r in records.items()]
        with self._transaction() as db:
            db.execute("DELETE FROM rollouts")
            db.executemany("INSERT INTO rollouts(model, record) VALUES(?, ?)", rows)

    def generation(self) -> int:
        value = self._meta("generation")
        return int(value) if value is not None else 0

    def next_generation(self, *, above: int = 0) -> int:
        """``above``: the highest generation in use by engines this controller did not number (adopted
        from another controller or an older copy of this data dir); the counter moves past it, so no
        new replica takes an adopted one's id."""
        with self._transaction() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
            generation = max(int(row[0]) if row else 0, above) + 1
            db.execute("INSERT INTO meta(key, value) VALUES('generation', ?) "
                       "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (str(generation),))
        return generation

    # --- operators' decisions and this controller's name ------------------------------------------
    def node_states(self) -> dict[str, str]:
        with self._locked() as db:
            return dict(db.execute("SELECT node, state FROM node_states").fetchall())

    def set_node_state(self, node: str, state: str | None) -> None:
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
        with self._locked() as db:
            cur = db.execute("INSERT INTO events(time, kind, subject, message) VALUES(?, ?, ?, ?)",
                             (t, kind, subject, message))
        event = Event(int(cur.lastrowid or 0), t, kind, subject, message)
        self._audit_automation(event)
        return event

    def events(self, *, after: int = 0, limit: int = 200) -> list[Event]:
        with self._locked() as db:
            rows = db.execute(
                "SELECT id, time, kind, subject, message FROM events WHERE id > ? ORDER BY id DESC LIMIT ?",
                (after, limit),
            ).fetchall()
        # Redacted again as read: rows an earlier version stored whole are shown without it too.
        return [Event(i, t, kind, redact(subject), redact(message)) for i, t, kind, subject, message in reversed(rows)]

    # --- the usage ledger -----------------------------------------------------------------
    def record_usage(self, batch: UsageBatch, *, now: float | None = None) -> bool:
        """One transaction for the rows and the seq, so a crash between them cannot count a resent
        batch twice."""
        t = time.time() if now is None else now
        upsert = (f"INSERT INTO usage(minute, tenant, key, model, {', '.join(USAGE_COUNTS)}) "
                  f"VALUES(?, ?, ?, ?, {', '.join('?' * len(USAGE_COUNTS))}) "
                  "ON CONFLICT(minute, tenant, key, model) DO UPDATE SET "
                  + ", ".join(f"{c} = {c} + excluded.{c}" for c in USAGE_COUNTS))
        rows = [(r.minute, r.tenant, r.key, r.model, *(getattr(r, c) for c in USAGE_COUNTS)) for r in batch.rows]
        with self._transaction() as db:
            last = db.execute("SELECT seq FROM usage_batches WHERE instance = ?", (batch.instance,)).fetchone()
            if last is not None and batch.seq <= last[0]:
                return False
            db.executemany(upsert, rows)
            db.execute("INSERT INTO usage_batches(instance, seq, time) VALUES(?, ?, ?) ON CONFLICT(instance) "
                       "DO UPDATE SET seq = excluded.seq, time = excluded.time", (batch.instance, batch.seq, t))
        return True

    def usage_seq(self, instance: str) -> int:
        with self._locked() as db:
            row = db.execute("SELECT seq FROM usage_batches WHERE instance = ?", (instance,)).fetchone()
        return int(row[0]) if row is not None else 0

    def usage(self, since: float, until: float, *, by: tuple[str, ...] = USAGE_GROUPS, step: int = 0,
              where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        sql, names = usage_query(by, step, where, sums=_USAGE_SUMS, mark="?")
        db, lock = self._reader_for_queries()
        with lock:
            try:
                rows = db.execute(sql, (int(since), int(until), *(where or {}).values())).fetchall()
            except sqlite3.Error as exc:
                raise DatabaseError(f"{self.path}: {exc}") from exc
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
        with self._transaction() as db:
            old = db.execute("SELECT COUNT(*) FROM usage WHERE minute < ? AND minute % 3600 != 0",
                             (cutoff,)).fetchone()[0]
            if old:
                db.execute("CREATE TEMP TABLE hours AS SELECT minute / 3600 * 3600 AS minute, tenant, key, "
                           f"model, {_USAGE_SUMS} FROM usage WHERE minute < ? GROUP BY 1, tenant, key, model",
                           (cutoff,))
                db.execute("DELETE FROM usage WHERE minute < ?", (cutoff,))
                db.execute(f"INSERT INTO usage(minute, tenant, key, model, {cols}) SELECT * FROM hours")
                db.execute("DROP TABLE hours")
        return int(old)

    # --- the leader lease: compare-and-swap in one write transaction, on SQLite's clock --------
    def acquire_lease(self, holder: str, *, ttl: float) -> LeaseGrant | None:
        ttl = check_ttl(ttl)
        with self._transaction() as db:
            now = db.execute(_NOW).fetchone()[0]
            row = db.execute("SELECT holder, epoch, expires FROM lease WHERE name = ?", (LEASE_NAME,)).fetchone()
            if row is not None and row[0] is not None and row[2] > now:
                return None
            epoch = (row[1] if row is not None else 0) + 1
            db.execute("INSERT INTO lease(name, holder, epoch, expires, taken, renewed) VALUES(?, ?, ?, ?, ?, ?) "
                       "ON CONFLICT(name) DO UPDATE SET holder = excluded.holder, epoch = excluded.epoch, "
                       "expires = excluded.expires, taken = excluded.taken, renewed = excluded.renewed",
                       (LEASE_NAME, holder, epoch, now + ttl, now, now))
        return LeaseGrant(epoch, now + ttl, ttl)

    def renew_lease(self, holder: str, epoch: int, *, ttl: float) -> LeaseGrant | None:
        ttl = check_ttl(ttl)
        with self._transaction() as db:
            now = db.execute(_NOW).fetchone()[0]
            cur = db.execute("UPDATE lease SET expires = ?, renewed = ? "
                             "WHERE name = ? AND holder = ? AND epoch = ? AND expires > ?",
                             (now + ttl, now, LEASE_NAME, holder, epoch, now))
        return LeaseGrant(epoch, now + ttl, ttl) if cur.rowcount == 1 else None

    def release_lease(self, holder: str, epoch: int) -> bool:
        with self._transaction() as db:
            now = db.execute(_NOW).fetchone()[0]
            cur = db.execute("UPDATE lease SET holder = NULL, expires = MIN(expires, ?) "
                             "WHERE name = ? AND holder = ? AND epoch = ?", (now, LEASE_NAME, holder, epoch))
        return cur.rowcount == 1

    def leadership(self) -> Leadership:
        with self._locked() as db:
            now = db.execute(_NOW).fetchone()[0]
            row = db.execute("SELECT holder, epoch, expires, taken, renewed FROM lease WHERE name = ?",
                             (LEASE_NAME,)).fetchone()
        if row is None:
            return Leadership(None, 0, None, None, None, now)
        return Leadership(row[0], row[1], row[2], row[3], row[4], now)

    def check_in(self, holder: str, *, url: str | None, role: str) -> list[ControllerSeen]:
        with self._transaction() as db:
            now = db.execute(_NOW).fetchone()[0]
            db.execute("INSERT INTO controllers(holder, url, role, seen) VALUES(?, ?, ?, ?) ON CONFLICT(holder) "
                       "DO UPDATE SET url = excluded.url, role = excluded.role, seen = excluded.seen",
                       (holder, url, role, now))
            db.execute("DELETE FROM controllers WHERE seen < ?", (now - FORGET_AFTER,))
            rows = db.execute("SELECT holder, url, role, seen FROM controllers ORDER BY seen DESC").fetchall()
        return [ControllerSeen(h, u, r, max(0.0, now - seen)) for h, u, r, seen in rows]


def _version(db: sqlite3.Connection) -> int:
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" in tables:
        row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is not None:
            return int(row[0])
    return 1 if "kv" in tables else 0


OPEN_PATIENCE = 30.0  # seconds a busy database may keep an opening controller waiting


def _opened(where: str) -> sqlite3.Connection:
    """A connection in WAL mode with the current schema. Processes opening a new file together
    contend for it: switching to WAL can answer "locked" at once, without SQLite's busy wait,
    while another connection holds the file, so a locked answer is tried again (bounded)."""
    deadline = time.monotonic() + OPEN_PATIENCE
    pause = 0.01
    while True:
        try:
            db = sqlite3.connect(where, check_same_thread=False, isolation_level=None, timeout=10.0)
        except sqlite3.Error as exc:
            raise ConfigError(f"{where}: cannot use the store: {exc}") from exc
        try:
            db.execute("PRAGMA journal_mode=WAL")
            _upgrade(db, where)
            return db
        except sqlite3.OperationalError as exc:
            db.close()
            if not _busy(exc) or time.monotonic() + pause > deadline:
                raise ConfigError(f"{where}: cannot use the store: {exc}") from exc
        except sqlite3.Error as exc:  # not a database, unwritable
            db.close()
            raise ConfigError(f"{where}: cannot use the store: {exc}") from exc
        except BaseException:
            db.close()
            raise
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _upgrade(db: sqlite3.Connection, where: str) -> None:
    """Bring the database to SCHEMA_VERSION, in one transaction; refuse one from a newer llmgw.
    Every version's tables are created if missing and the one column added since (usage's refused)
    with them, so one step brings any older schema up; v1's key–value rows are moved into them."""
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
        if "refused" not in {row[1] for row in db.execute("PRAGMA table_info(usage)")}:
            db.execute("ALTER TABLE usage ADD COLUMN refused INTEGER NOT NULL DEFAULT 0")
        db.execute("INSERT INTO meta(key, value) VALUES('schema_version', ?) "
                   "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    if version:
        log.info("%s: state migrated from schema %d to %d", where, version, SCHEMA_VERSION)


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

