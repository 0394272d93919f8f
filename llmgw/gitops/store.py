"""What must survive a controller restart, in SQLite in the data dir.

The applied revision (so a restart comes back on it without re-applying anything), a
commit held for confirmation, the last rejection, node cordons, and the event log. One
connection, used from one thread at a time behind a lock: SQLite serialises writers
anyway, and the controller writes a few rows a minute.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    subject TEXT NOT NULL,
    message TEXT NOT NULL
);
"""


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

    def open(self) -> Store:
        if self._db is None:
            if str(self.path) != ":memory:":
                # 0700: the database holds the fleet's events and state; on a machine that also
                # runs engines or other users, it is the controller's business only.
                Path(self.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
        return self

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("Store.open() was not called")
        return self._db

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` (JSON); None deletes the key. Each write is its own transaction."""
        with self._lock:
            if value is None:
                self.db.execute("DELETE FROM kv WHERE key = ?", (key,))
            else:
                self.db.execute(
                    "INSERT INTO kv(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, json.dumps(value)),
                )

    def add_event(self, kind: str, subject: str, message: str, *, now: float | None = None) -> Event:
        t = time.time() if now is None else now
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
        return [Event(*r) for r in reversed(rows)]
