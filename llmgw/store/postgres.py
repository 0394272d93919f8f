"""The controller's store in PostgreSQL (psycopg 3): one database several controllers share, one
of them leading by the lease row (DESIGN §5 "High availability").

The same records as the SQLite store, row for row (the follower's records and the replicas as
JSON text, so a NUL or a number survives as it does there), with this database's own schema
version and migrations, applied under an advisory lock so controllers starting together do not
race. The lease is a compare-and-swap judged on the server's clock (``clock_timestamp()`` read
once in the statement): no controller's clock takes part, so two controllers whose clocks
disagree still agree on who leads.

Every call is bounded: a connect timeout on each (re)connect, and on the session a statement
timeout, a lock timeout, an idle-in-transaction timeout and a TCP user timeout (a server that
vanished without a word is noticed). A connection that failed is dropped and the next call
opens a new one. The URL's password is used and never shown: :attr:`where`, the errors and the
logs carry it redacted (``postgresql://llmgw:***@db/llmgw``); PGPASSWORD or a passfile keep it
out of the config altogether.

Two connections, each used by one thread at a time behind its lock, as in the SQLite store:
one for everything, one for the ledger's long queries.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Self

import psycopg
from psycopg.conninfo import conninfo_to_dict

from llmgw.contract import USAGE_COUNTS, UsageBatch
from llmgw.decide.replica import Replica
from llmgw.errors import ConfigError
from llmgw.redact import MASK, redact
from llmgw.store.audit import COLUMNS, GENESIS, AuditEntry, AuditRecord, automation_entry, from_row, redacted, row_hash
from llmgw.store.base import (
    BIGINT_MAX,
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

DEFAULT_TIMEOUT = 5.0  # seconds, per connect and per statement
_MIGRATION_LOCK = 0x6C6C6D67  # "llmg": the advisory lock migrations are applied under
# Each entry brings the schema from its index to its index + 1, in one transaction.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE sync (kind TEXT PRIMARY KEY, record TEXT NOT NULL);
    CREATE TABLE replicas (id TEXT PRIMARY KEY, record TEXT NOT NULL);
    CREATE TABLE rollouts (model TEXT PRIMARY KEY, record TEXT NOT NULL);
    CREATE TABLE node_states (node TEXT PRIMARY KEY, state TEXT NOT NULL);
    CREATE TABLE events (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        time DOUBLE PRECISION NOT NULL,
        kind TEXT NOT NULL,
        subject TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE TABLE usage (
        minute BIGINT NOT NULL,
        tenant TEXT NOT NULL,
        key TEXT NOT NULL,
        model TEXT NOT NULL,
        requests BIGINT NOT NULL,
        errors BIGINT NOT NULL,
        prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL,
        counted_from_stream BIGINT NOT NULL,
        PRIMARY KEY (minute, tenant, key, model)
    );
    CREATE TABLE usage_batches (instance TEXT PRIMARY KEY, seq BIGINT NOT NULL, time DOUBLE PRECISION NOT NULL);
    CREATE TABLE lease (
        name TEXT PRIMARY KEY,
        holder TEXT,
        epoch BIGINT NOT NULL,
        expires TIMESTAMPTZ NOT NULL,
        taken TIMESTAMPTZ,
        renewed TIMESTAMPTZ
    );
    """,
    """
    CREATE TABLE controllers (holder TEXT PRIMARY KEY, url TEXT, role TEXT NOT NULL, seen TIMESTAMPTZ NOT NULL);
    """,
    """
    CREATE TABLE api_keys (name TEXT PRIMARY KEY, record TEXT NOT NULL);
    """,
    """
    ALTER TABLE usage ADD COLUMN refused BIGINT NOT NULL DEFAULT 0;
    """,
    """
    CREATE TABLE audit (
        id BIGINT PRIMARY KEY,
        time DOUBLE PRECISION NOT NULL,
        who TEXT NOT NULL,
        role TEXT NOT NULL,
        source TEXT NOT NULL,
        action TEXT NOT NULL,
        result TEXT NOT NULL,
        revision TEXT NOT NULL,
        prev TEXT NOT NULL UNIQUE,  -- a second guard: two rows never follow one (a forked chain)
        hash TEXT NOT NULL
    );
    """,
)
_AUDIT_LOCK = 0x6C6C6D61  # "llma": appends to the audit chain, one at a time across controllers
SCHEMA_VERSION = len(MIGRATIONS)
# SUM of BIGINT is NUMERIC (exact); like the SQLite store's TOTAL, it saturates instead of failing.
_USAGE_SUMS = ", ".join(f"LEAST(SUM({c}), {BIGINT_MAX})::bigint" for c in USAGE_COUNTS)
_NOW = "(SELECT clock_timestamp() AS now) AS t"
_EPOCH = "extract(epoch FROM {})::float8"


def _text(value: str) -> str:
    """PostgreSQL's text cannot hold NUL, which names off the wire and engines' messages may: it
    becomes U+FFFD, so the row is stored (and a router's batch acknowledged) instead of refused."""
    return value.replace("\x00", "\ufffd")


class PostgresStore(JsonRecords):
    """The controller's durable state in PostgreSQL at ``url`` (``postgresql://…``); see the module."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT, application_name: str = "llmgw") -> None:
        self._url = url
        try:
            password = conninfo_to_dict(url).get("password")
        except psycopg.Error as exc:
            raise ConfigError(f"store: {redact(url)} is not a PostgreSQL URL ({redact(str(exc))})") from None
        self._password = str(password) if password else None
        self.timeout = timeout
        self.application_name = application_name
        self._main = _Line(self._connect, self._scrub)
        self._reader = _Line(self._connect, self._scrub)

    @property
    def where(self) -> str:
        return self._scrub(self._url)

    def _scrub(self, text: str) -> str:
        """``text`` with URLs redacted and this store's password, however it is spelled there, masked."""
        text = redact(text)
        return text.replace(self._password, MASK) if self._password else text

    def _connect(self) -> psycopg.Connection[Any]:
        ms = max(1, int(self.timeout * 1000))
        options = " ".join((str(conninfo_to_dict(self._url).get("options") or ""), f"-c statement_timeout={ms}",
                            f"-c lock_timeout={ms}", f"-c idle_in_transaction_session_timeout={4 * ms}")).strip()
        return psycopg.connect(
            self._url, autocommit=True, connect_timeout=max(2, math.ceil(self.timeout)), options=options,
            application_name=self.application_name, keepalives=1, keepalives_idle=max(1, int(self.timeout)),
            keepalives_interval=1, keepalives_count=3, tcp_user_timeout=4 * ms)

    # --- opening, and the schema ---------------------------------------------------------
    def open(self) -> Self:
        try:
            with self._main.use() as conn:
                _upgrade(conn, self.where)
        except DatabaseError as exc:  # its text scrubbed already; the driver's error is not chained
            self.close()
            raise ConfigError(f"{self.where}: cannot use the store: {exc}") from None
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self._reader.close()
        self._main.close()

    def _one(self, sql: str, args: Mapping[str, Any] | tuple[Any, ...]) -> Any:
        with self._main.use() as conn:
            row = conn.execute(sql, args).fetchone()
        return row[0] if row else None

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._main.use() as conn:
            return conn.execute(sql, args).fetchall()

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._main.use() as conn:
            conn.execute(sql, args)

    def _meta(self, key: str) -> str | None:
        return self._one("SELECT value FROM meta WHERE key = %s", (key,))

    # --- the GitOps follower's memory (its records: llmgw.store.base.JsonRecords) ----------
    def _sync(self, kind: SyncKind) -> Any:
        raw = self._one("SELECT record FROM sync WHERE kind = %s", (kind.value,))
        return json.loads(raw) if raw is not None else None

    def _set_sync(self, kind: SyncKind, record: Any) -> None:
        if record is None:
            self._write("DELETE FROM sync WHERE kind = %s", (kind.value,))
        else:
            self._write("INSERT INTO sync(kind, record) VALUES(%s, %s) "
                        "ON CONFLICT(kind) DO UPDATE SET record = excluded.record", (kind.value, json.dumps(record)))

    # --- API keys made by `llmgw keys` (hashes only) ------------------------------------------
    def api_keys(self) -> list[dict[str, Any]]:
        return [json.loads(r) for (r,) in self._all("SELECT record FROM api_keys ORDER BY name")]

    def add_api_key(self, entry: Mapping[str, Any]) -> bool:
        with self._main.use() as conn, conn.transaction():
            cur = conn.execute("INSERT INTO api_keys(name, record) VALUES(%s, %s) ON CONFLICT(name) DO NOTHING",
                               (_text(str(entry["name"])), json.dumps(dict(entry))))
            return cur.rowcount == 1

    def replace_api_key(self, name: str, entry: Mapping[str, Any]) -> bool:
        with self._main.use() as conn, conn.transaction():
            if conn.execute("DELETE FROM api_keys WHERE name = %s", (_text(name),)).rowcount != 1:
                return False
            conn.execute("INSERT INTO api_keys(name, record) VALUES(%s, %s)",
                         (_text(str(entry["name"])), json.dumps(dict(entry))))
            return True

    # --- the reconciler's memory ------------------------------------------------------------
    def replicas(self) -> list[Replica]:
        return [Replica.from_json(json.loads(r[0])) for r in self._all("SELECT record FROM replicas ORDER BY id")]

    def save_replicas(self, replicas: Iterable[Replica]) -> None:
        self._replace("replicas", "id", [(_text(r.id), json.dumps(r.to_json())) for r in replicas])

    def rollout_records(self) -> dict[str, dict[str, Any]]:
        return decode_rollouts([(m, r) for m, r in self._all("SELECT model, record FROM rollouts")], log)

    def save_rollout_records(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        self._replace("rollouts", "model", [(_text(m), json.dumps(r)) for m, r in records.items()])

    def _replace(self, table: str, key: str, rows: list[tuple[str, str]]) -> None:
        """``table``'s rows replaced by ``rows``, in one transaction (names from this module only)."""
        with self._main.use() as conn, conn.transaction():
            conn.execute(f"DELETE FROM {table}")
            with conn.cursor() as cur:
                cur.executemany(f"INSERT INTO {table}({key}, record) VALUES(%s, %s)", rows)

    def generation(self) -> int:
        value = self._meta("generation")
        return int(value) if value is not None else 0

    def next_generation(self, *, above: int = 0) -> int:
        """One statement: two controllers asking at once get two generations."""
        value = self._one("INSERT INTO meta(key, value) VALUES('generation', (%(above)s::bigint + 1)::text) "
                          "ON CONFLICT(key) DO UPDATE SET value = (GREATEST(meta.value::bigint, %(above)s::bigint) "
                          "+ 1)::text RETURNING value", {"above": int(above)})
        return int(value)

    # --- operators' decisions and this controller's name ------------------------------------------
    def node_states(self) -> dict[str, str]:
        return {node: state for node, state in self._all("SELECT node, state FROM node_states")}

    def set_node_state(self, node: str, state: str | None) -> None:
        if state is None:
            self._write("DELETE FROM node_states WHERE node = %s", (_text(node),))
        else:
            self._write("INSERT INTO node_states(node, state) VALUES(%s, %s) "
                        "ON CONFLICT(node) DO UPDATE SET state = excluded.state", (_text(node), _text(state)))

    def controller_id(self) -> str | None:
        return self._meta("controller_id")

    def set_controller_id(self, cid: str) -> None:
        self._write("INSERT INTO meta(key, value) VALUES('controller_id', %s) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (_text(cid),))

    # --- the event log -----------------------------------------------------------------
    def add_event(self, kind: str, subject: str, message: str, *, now: float | None = None) -> Event:
        t = time.time() if now is None else now
        kind, subject, message = _text(kind), _text(redact(subject)), _text(redact(message))
        eid = self._one("INSERT INTO events(time, kind, subject, message) VALUES(%s, %s, %s, %s) RETURNING id",
                        (t, kind, subject, message))
        event = Event(int(eid), t, kind, subject, message)
        self._audit_automation(event)
        return event

    def events(self, *, after: int = 0, limit: int = 200) -> list[Event]:
        rows = self._all("SELECT id, time, kind, subject, message FROM events WHERE id > %s ORDER BY id DESC LIMIT %s",
                         (after, max(0, limit)))
        return [Event(i, t, kind, redact(subject), redact(message)) for i, t, kind, subject, message in reversed(rows)]

    # --- the usage ledger -----------------------------------------------------------------
    # --- the audit trail (append-only: no call here updates or deletes a row) -----------------
    def _audit_automation(self, event: Event) -> None:
        applied = self.applied()
        entry = automation_entry(event.kind, event.subject, event.message, event.time,
                                 applied.sha if applied is not None else "")
        if entry is not None:
            self.append_audit(entry)

    def append_audit(self, entry: AuditEntry) -> AuditRecord:
        """One row, chained to the last; an advisory lock orders two controllers' appends, so no
        two rows share a previous hash."""
        e = redacted(entry)
        # Hashed as stored: PostgreSQL text takes no NUL, which _text drops.
        entry = e = AuditEntry(e.time, *(_text(v) for v in (e.who, e.role, e.source, e.action, e.result, e.revision)))
        with self._main.use() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_AUDIT_LOCK,))
            last = conn.execute("SELECT id, hash FROM audit ORDER BY id DESC LIMIT 1").fetchone()
            row_id, prev = (int(last[0]) + 1, str(last[1])) if last else (1, GENESIS)
            digest = row_hash(row_id, e, prev)
            conn.execute(f"INSERT INTO audit({COLUMNS}) VALUES(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                         (row_id, e.time, e.who, e.role, e.source, e.action, e.result, e.revision, prev, digest))
        return AuditRecord(row_id, entry, prev, digest)

    def audit(self, *, since: float = 0.0, after: int = 0, limit: int = 0, last: int = 0) -> list[AuditRecord]:
        sql = f"SELECT {COLUMNS} FROM audit WHERE time >= %s AND id > %s ORDER BY id"
        if last > 0:
            sql = f"SELECT * FROM ({sql} DESC LIMIT {int(last)}) AS newest ORDER BY id"
        elif limit > 0:
            sql += f" LIMIT {int(limit)}"
        return [from_row(r) for r in self._all(sql, (since, after))]

    def record_usage(self, batch: UsageBatch, *, now: float | None = None) -> bool:
        """The seq first, moved only forward (its row lock orders two controllers recording the same
        router's batches), then the rows in key order (so two transactions never wait on each other
        in a circle), all in one transaction."""
        t = time.time() if now is None else now
        cols = ", ".join(USAGE_COUNTS)
        upsert = (f"INSERT INTO usage(minute, tenant, key, model, {cols}) "
                  f"VALUES(%s, %s, %s, %s, {', '.join(['%s'] * len(USAGE_COUNTS))}) "
                  "ON CONFLICT(minute, tenant, key, model) DO UPDATE SET "
                  + ", ".join(f"{c} = LEAST(usage.{c}::numeric + excluded.{c}, {BIGINT_MAX})::bigint"
                              for c in USAGE_COUNTS))
        rows = sorted((r.minute, _text(r.tenant), _text(r.key), _text(r.model), *(getattr(r, c) for c in USAGE_COUNTS))
                      for r in batch.rows)
        with self._main.use() as conn, conn.transaction():
            moved = conn.execute(
                "INSERT INTO usage_batches(instance, seq, time) VALUES(%s, %s, %s) ON CONFLICT(instance) DO UPDATE "
                "SET seq = excluded.seq, time = excluded.time WHERE usage_batches.seq < excluded.seq RETURNING seq",
                (_text(batch.instance), batch.seq, t)).fetchone()
            if moved is None:
                return False
            with conn.cursor() as cur:
                cur.executemany(upsert, rows)
        return True

    def usage_seq(self, instance: str) -> int:
        with self._main.use() as conn:
            row = conn.execute("SELECT seq FROM usage_batches WHERE instance = %s", (_text(instance),)).fetchone()
        return int(row[0]) if row is not None else 0

    def usage(self, since: float, until: float, *, by: tuple[str, ...] = USAGE_GROUPS, step: int = 0,
              where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        sql, names = usage_query(by, step, where, sums=_USAGE_SUMS, mark="%s")
        with self._reader.use() as conn:
            rows = conn.execute(sql, (int(since), int(until), *(_text(v) for v in (where or {}).values()))).fetchall()
        return [dict(zip(names, r[:-1], strict=True)) for r in rows if r[-1]]

    def compact_usage(self, *, now: float | None = None) -> int:
        """The old minutes are deleted and summed in one statement (DELETE … RETURNING), so a row a
        late batch adds meanwhile is either folded in or left alone, never lost."""
        cutoff = int((time.time() if now is None else now) - USAGE_MINUTES_KEPT) // 3600 * 3600
        cols = ", ".join(USAGE_COUNTS)
        with self._main.use() as conn, conn.transaction():
            old = conn.execute("SELECT COUNT(*) FROM usage WHERE minute < %s AND minute %% 3600 != 0",
                               (cutoff,)).fetchone()
            if not old or not old[0]:
                return 0
            hours = conn.execute(
                f"WITH gone AS (DELETE FROM usage WHERE minute < %s RETURNING *) SELECT minute / 3600 * 3600, "
                f"tenant, key, model, {_USAGE_SUMS} FROM gone GROUP BY 1, tenant, key, model", (cutoff,)).fetchall()
            with conn.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO usage(minute, tenant, key, model, {cols}) VALUES(%s, %s, %s, %s, "
                    f"{', '.join(['%s'] * len(USAGE_COUNTS))}) ON CONFLICT(minute, tenant, key, model) DO UPDATE SET "
                    + ", ".join(f"{c} = LEAST(usage.{c}::numeric + excluded.{c}, {BIGINT_MAX})::bigint"
                                for c in USAGE_COUNTS), hours)
        return int(old[0])

    # --- the leader lease: each call one statement, judged on the server's clock ----------------
    def acquire_lease(self, holder: str, *, ttl: float) -> LeaseGrant | None:
        ttl = check_ttl(ttl)
        with self._main.use() as conn:
            row = conn.execute(
                "INSERT INTO lease AS l (name, holder, epoch, expires, taken, renewed) "
                f"SELECT %(name)s, %(holder)s, 1, t.now + %(ttl)s * interval '1 second', t.now, t.now FROM {_NOW} "
                "ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, epoch = l.epoch + 1, "
                "expires = excluded.expires, taken = excluded.taken, renewed = excluded.renewed "
                "WHERE l.holder IS NULL OR l.expires <= excluded.taken "
                f"RETURNING l.epoch, {_EPOCH.format('l.expires')}",
                {"name": LEASE_NAME, "holder": _text(holder), "ttl": ttl}).fetchone()
        return LeaseGrant(int(row[0]), float(row[1]), ttl) if row else None

    def renew_lease(self, holder: str, epoch: int, *, ttl: float) -> LeaseGrant | None:
        ttl = check_ttl(ttl)
        with self._main.use() as conn:
            row = conn.execute(
                f"UPDATE lease AS l SET expires = t.now + %s * interval '1 second', renewed = t.now FROM {_NOW} "
                f"WHERE l.name = %s AND l.holder = %s AND l.epoch = %s AND l.expires > t.now "
                f"RETURNING {_EPOCH.format('l.expires')}", (ttl, LEASE_NAME, _text(holder), epoch)).fetchone()
        return LeaseGrant(epoch, float(row[0]), ttl) if row else None

    def release_lease(self, holder: str, epoch: int) -> bool:
        with self._main.use() as conn:
            row = conn.execute(
                f"UPDATE lease AS l SET holder = NULL, expires = LEAST(l.expires, t.now) FROM {_NOW} "
                "WHERE l.name = %s AND l.holder = %s AND l.epoch = %s RETURNING l.epoch",
                (LEASE_NAME, _text(holder), epoch)).fetchone()
        return row is not None

    def leadership(self) -> Leadership:
        with self._main.use() as conn:
            row = conn.execute(
                f"SELECT {_EPOCH.format('t.now')}, l.holder, l.epoch, {_EPOCH.format('l.expires')}, "
                f"{_EPOCH.format('l.taken')}, {_EPOCH.format('l.renewed')} FROM {_NOW} "
                "LEFT JOIN lease AS l ON l.name = %s", (LEASE_NAME,)).fetchone()
        assert row is not None  # one row always: the clock's
        now, holder, epoch, expires, taken, renewed = row
        return Leadership(holder, int(epoch or 0), expires, taken, renewed, now)

    def check_in(self, holder: str, *, url: str | None, role: str) -> list[ControllerSeen]:
        with self._main.use() as conn, conn.transaction():
            conn.execute(
                f"INSERT INTO controllers(holder, url, role, seen) SELECT %s, %s, %s, t.now FROM {_NOW} "
                "ON CONFLICT(holder) DO UPDATE SET url = excluded.url, role = excluded.role, seen = excluded.seen",
                (_text(holder), _text(url) if url else None, role))
            conn.execute(f"DELETE FROM controllers USING {_NOW} WHERE seen < t.now - %s * interval '1 second'",
                         (FORGET_AFTER,))
            rows = conn.execute(f"SELECT holder, url, role, {_EPOCH.format('t.now - seen')} FROM controllers, "
                                f"{_NOW} ORDER BY seen DESC").fetchall()
        return [ControllerSeen(h, u, r, max(0.0, float(age))) for h, u, r, age in rows]


class _Line:
    """One connection, used by one thread at a time; dropped when a call fails on it, and opened
    again by the next call. psycopg's errors leave as :class:`DatabaseError` (a StoreError)."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], scrub: Callable[[str], str]) -> None:
        self._connect = connect
        self._scrub = scrub
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    @contextmanager
    def use(self) -> Iterator[psycopg.Connection[Any]]:
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                yield self._conn
            except psycopg.Error as exc:
                if self._conn is not None and (self._conn.broken or isinstance(exc, psycopg.OperationalError)):
                    self._drop()
                raise DatabaseError(self._scrub(str(exc))) from exc

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


def _version(conn: psycopg.Connection[Any]) -> int:
    exists = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables WHERE tablename = 'meta' "
                          "AND schemaname = current_schema())").fetchone()
    if not exists or not exists[0]:
        return 0
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return int(row[0]) if row else 0


def _upgrade(conn: psycopg.Connection[Any], where: str) -> None:
    """Bring the database to SCHEMA_VERSION, all steps and the version in one transaction, under the
    migrations' advisory lock (held by the session around it, so the version is read again in a
    transaction that begins after another controller's migration committed); refuse a database
    made by a newer llmgw rather than half-read it."""
    version = _version(conn)
    if version < SCHEMA_VERSION:
        conn.execute("SELECT pg_advisory_lock(%s)", (_MIGRATION_LOCK,))
        try:
            with conn.transaction():
                version = _version(conn)  # again under the lock: another controller may have done it
                for step in range(version, SCHEMA_VERSION):
                    conn.execute(MIGRATIONS[step])  # several statements: no parameters, simple protocol
                if version < SCHEMA_VERSION:
                    conn.execute("INSERT INTO meta(key, value) VALUES('schema_version', %s) "
                                 "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))
                    log.info("%s: store schema %d brought to %d", where, version, SCHEMA_VERSION)
        finally:
            if not conn.broken:
                conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATION_LOCK,))
    if version > SCHEMA_VERSION:
        raise ConfigError(f"{where}: made by a newer llmgw (store schema {version}; this one reads up to "
                          f"{SCHEMA_VERSION}); run that version")
