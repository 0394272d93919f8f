"""The audit trail in both stores (issue 41): appended and read back, its chain verified, and a
row edited or deleted behind the store's back found by the row it happened at; two controllers
appending at once on one PostgreSQL database never fork the chain."""

from __future__ import annotations

import threading

from llmgw.store.audit import GENESIS, AuditEntry, verify
from llmgw.store.protocol import Store
from tests.store.conftest import Backend


def entry(n: int, who: str = "ada@example.com") -> AuditEntry:
    return AuditEntry(1000.0 + n, who, "operator", "10.0.0.7", f"POST /api/v1/nodes/n{n}/state", "200", "abc123")


def test_rows_are_chained_read_back_and_verified(store: Store) -> None:
    made = [store.append_audit(entry(n)) for n in range(5)]
    assert [r.id for r in made] == [1, 2, 3, 4, 5] and made[0].prev == GENESIS
    assert all(b.prev == a.hash for a, b in zip(made, made[1:], strict=False))
    assert store.audit() == made
    assert [r.id for r in store.audit(after=3)] == [4, 5]
    assert [r.id for r in store.audit(since=1002.0, limit=2)] == [3, 4]
    assert [r.id for r in store.audit(last=2)] == [4, 5]
    assert verify(store.audit()).to_json() == {"ok": True, "rows": 5, "broken_at": None, "why": None}


def test_a_credential_in_what_is_recorded_is_not_kept(store: Store) -> None:
    store.append_audit(AuditEntry(1.0, "admin-token", "admin", "127.0.0.1", "POST /api/v1/sync",
                                  "500 fetch https://oauth2:glpat-SECRET@git.example/c.git failed", ""))
    (row,) = store.audit()
    assert "SECRET" not in row.entry.result and verify([row]).ok


def test_a_row_edited_behind_the_stores_back_is_found(backend: Backend) -> None:
    store = backend.open()
    for n in range(4):
        store.append_audit(entry(n))
    backend.sql("UPDATE audit SET who = ? WHERE id = ?", ("someone-else", 3))
    verdict = verify(store.audit())
    assert (verdict.ok, verdict.broken_at) == (False, 3) and "changed after it was written" in (verdict.why or "")


def test_a_row_deleted_behind_the_stores_back_is_found(backend: Backend) -> None:
    store = backend.open()
    for n in range(4):
        store.append_audit(entry(n))
    backend.sql("DELETE FROM audit WHERE id = ?", (2,))
    verdict = verify(store.audit())
    assert (verdict.ok, verdict.broken_at) == (False, 3) and "row 2 is missing" in (verdict.why or "")
    backend.sql("DELETE FROM audit WHERE id = ?", (1,))  # the first row gone: the second no longer starts it
    assert verify(store.audit()).broken_at == 3


def test_two_stores_appending_at_once_never_fork_the_chain(backend: Backend) -> None:
    stores = [backend.open(), backend.open()]

    def append(s: Store, who: str) -> None:
        for n in range(25):
            s.append_audit(entry(n, who))

    threads = [threading.Thread(target=append, args=(s, f"controller-{i}")) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rows = stores[0].audit()
    assert len(rows) == 50 and len({r.prev for r in rows}) == 50 and verify(rows).ok


def test_the_controllers_own_acts_go_on_the_chain_with_the_applied_revision(store: Store) -> None:
    from llmgw.store.records import Applied

    store.set_applied(Applied("f00d" * 10, 5.0))
    store.add_event("replica-ready", "chat-g1", "ready")  # no act: an event only
    store.add_event("rollout-promoted", "chat", "chat: the canary passed; promoting")
    (row,) = store.audit()
    e = row.entry
    assert (e.who, e.role, e.action, e.result, e.revision) == (
        "controller", "controller", "rollout-promoted chat", "chat: the canary passed; promoting", "f00d" * 10)
    assert verify(store.audit()).ok
