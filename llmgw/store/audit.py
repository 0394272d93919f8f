"""The audit trail's chain (issue 41): each row's hash covers its fields and the row before's,
so an edited, removed or reordered row breaks it where it happened. Pure: the stores compute
a row's hash with :func:`row_hash` on append, and :func:`verify` recomputes the chain.

Append-only: the stores have no call that updates or deletes a row, and no compaction touches
the table. The chain proves what the database holds was written in this order by an llmgw that
appended it; whoever can write the database directly can also rewrite the whole chain from the
edited row on, which is why the head (the last hash) is what to keep elsewhere for a later check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from llmgw.redact import redact

GENESIS = "0" * 64  # the "previous hash" of the first row


@dataclass(frozen=True)
class AuditEntry:
    """What is appended: who did what, from where, with what result, at which applied revision."""

    time: float
    who: str  # a person's name from the provider, "admin-token", "router:NAME", "controller"
    role: str
    source: str  # the client's address, or "controller" for its own automation
    action: str  # "POST /api/v1/nodes/n1/state", "rollout-promoted chat"
    result: str  # "200", "403 needs the operator role", "done"
    revision: str  # the applied catalog commit at that moment ("" before any)


@dataclass(frozen=True)
class AuditRecord:
    id: int
    entry: AuditEntry
    prev: str
    hash: str

    def to_json(self) -> dict[str, object]:
        e = self.entry
        return {"id": self.id, "time": e.time, "who": e.who, "role": e.role, "source": e.source,
                "action": e.action, "result": e.result, "revision": e.revision, "prev": self.prev, "hash": self.hash}


def row_hash(row_id: int, entry: AuditEntry, prev: str) -> str:
    """sha256 of the row's id, fields and the previous row's hash, as canonical JSON."""
    e = entry
    text = json.dumps([row_id, repr(e.time), e.who, e.role, e.source, e.action, e.result, e.revision, prev],
                      ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Verdict:
    ok: bool
    rows: int
    broken_at: int | None = None  # the id of the first row that does not hold
    why: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, "rows": self.rows, "broken_at": self.broken_at, "why": self.why}


def verify(records: Iterable[AuditRecord]) -> Verdict:
    """Recompute the chain over ``records`` (the whole table, in id order)."""
    prev, expected_id, n = GENESIS, None, 0
    for r in records:
        n += 1
        if expected_id is not None and r.id != expected_id:
            return Verdict(False, n, r.id, f"row {expected_id} is missing (the next row is {r.id})")
        if r.prev != prev:
            return Verdict(False, n, r.id, f"row {r.id} does not follow the row before it (its previous hash differs)")
        if row_hash(r.id, r.entry, r.prev) != r.hash:
            return Verdict(False, n, r.id, f"row {r.id} was changed after it was written (its hash differs)")
        prev, expected_id = r.hash, r.id + 1
    return Verdict(True, n)


COLUMNS = "id, time, who, role, source, action, result, revision, prev, hash"  # as from_row reads them


def redacted(entry: AuditEntry) -> AuditEntry:
    """A credential in a URL the action or result quotes stays out of the trail (llmgw.redact)."""
    return replace(entry, action=redact(entry.action), result=redact(entry.result))


def from_row(row: tuple[Any, ...]) -> AuditRecord:
    """A row of COLUMNS, from either store."""
    return AuditRecord(int(row[0]), AuditEntry(float(row[1]), *map(str, row[2:8])), str(row[8]), str(row[9]))


# The controller's own acts on the fleet, as its events name them: each also goes on the audit
# chain, by "controller" (what an operator asks for through the API is recorded there, by them).
AUTOMATION = frozenset({
    "applied", "rejected", "leader", "rollout-started", "rollout-promoted", "rollout-rolled-back", "rollout-aborted",
    "rollout-done", "stale-engine-stopped", "foreign-engine-stopped", "replica-drain-timeout",
})


def automation_entry(kind: str, subject: str, message: str, when: float, revision: str) -> AuditEntry | None:
    """The audit row an event of the controller's own is, or None for an event that is no act."""
    if kind not in AUTOMATION:
        return None
    return AuditEntry(when, "controller", "controller", "controller", f"{kind} {subject}".strip(), message, revision)
