"""The event log and the usage ledger, in either store: events in order and cut from the newest,
credentials never kept; each router batch counted once by (instance, seq), whoever records it."""

from __future__ import annotations

import threading

from llmgw.contract import UsageBatch, UsageRow
from llmgw.store.protocol import Store
from tests.store.conftest import Backend

ALL = (0, 2 ** 40)


def row(minute: int, *, tenant: str = "t", key: str = "k", model: str = "m", tokens: int = 10) -> UsageRow:
    return UsageRow(minute, tenant, key, model, requests=1, errors=0, prompt_tokens=tokens,
                    completion_tokens=2 * tokens, counted_from_stream=0)


def test_events_come_oldest_first_and_a_limit_keeps_the_newest(store: Store) -> None:
    added = [store.add_event("kind", f"subject-{i}", f"message {i}", now=1000.0 + i) for i in range(10)]
    assert [e.id for e in added] == sorted({e.id for e in added})  # ids grow with each event
    events = store.events()
    assert events == added
    assert [e.subject for e in store.events(limit=3)] == ["subject-7", "subject-8", "subject-9"]
    assert store.events(after=added[5].id) == added[6:]
    assert store.events(after=added[5].id, limit=2) == added[8:]
    assert store.events(after=added[-1].id) == [] and store.events(limit=0) == []
    assert added[3].time == 1003.0 and added[3].to_json()["message"] == "message 3"


def test_an_event_never_keeps_a_credential(backend: Backend, store: Store) -> None:
    event = store.add_event("fetch-failed", "https://user:tok3n@git.example.com/c.git",
                            "git said: fatal: https://x-token:tok3n@git.example.com/c.git?private_token=tok3n")
    assert "tok3n" not in event.subject + event.message
    stored = backend.sql("SELECT subject, message FROM events")
    assert "tok3n" not in repr(stored) and store.events()[0] == event


def test_events_from_two_stores_share_one_order(backend: Backend) -> None:
    a, b = backend.open(), backend.open()
    ids = [s.add_event("k", "s", str(i)).id for i, s in enumerate((a, b, a, b))]
    assert ids == sorted(ids) and [e.message for e in b.events()] == ["0", "1", "2", "3"]


def test_a_batch_is_counted_once_by_instance_and_seq(store: Store) -> None:
    batch = UsageBatch("router-1", 1, (row(60), row(60, key="k2"), row(120)))
    assert store.record_usage(batch) is True
    assert store.record_usage(batch) is False  # resent: its ack was lost
    assert store.record_usage(UsageBatch("router-1", 0, (row(60),))) is False  # older than the last
    assert store.usage(*ALL, by=()) == [{"requests": 3, "errors": 0, "prompt_tokens": 30, "completion_tokens": 60,
                                         "counted_from_stream": 0, "refused": 0}]
    assert store.record_usage(UsageBatch("router-2", 1, (row(60),))) is True  # another router's seq 1
    assert store.record_usage(UsageBatch("router-1", 2, (row(60),))) is True
    sums = {(r["key"], r["model"]): r["prompt_tokens"] for r in store.usage(*ALL, by=("key", "model"))}
    assert sums == {("k", "m"): 40, ("k2", "m"): 10}
    # What a controller asks a router to send again after a restore starts from here.
    assert (store.usage_seq("router-1"), store.usage_seq("router-2"), store.usage_seq("never")) == (2, 1, 0)


def test_one_batch_recorded_by_two_controllers_at_once_counts_once(backend: Backend) -> None:
    """A router resending to the new leader while the old one's transaction is still committing."""
    stores = [backend.open() for _ in range(4)]
    batch = UsageBatch("router-1", 7, tuple(row(60 * m, key=f"k{m % 3}") for m in range(1, 40)))
    results: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(len(stores))

    def record(store: Store) -> None:
        start.wait(timeout=30)
        recorded = store.record_usage(batch)
        with lock:
            results.append(recorded)

    threads = [threading.Thread(target=record, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [False, False, False, True]
    assert stores[0].usage(*ALL, by=())[0]["requests"] == 39


def test_the_ledger_groups_filters_and_steps(store: Store) -> None:
    store.record_usage(UsageBatch("r", 1, (
        row(3600, tenant="acme", model="a"), row(3660, tenant="acme", model="b"),
        row(7200, tenant="beta", model="a", tokens=5), row(10800, tenant="acme", model="a"))))
    by_tenant = store.usage(*ALL, by=("tenant",))
    assert [(r["tenant"], r["requests"], r["prompt_tokens"]) for r in by_tenant] == [("acme", 3, 30), ("beta", 1, 5)]
    hourly = store.usage(3600, 10800, by=("model",), step=3600, where={"tenant": "acme"})
    assert [(r["time"], r["model"], r["completion_tokens"]) for r in hourly] == [(3600, "a", 20), (3600, "b", 20)]
    assert store.usage(20000, 30000) == []


def test_compaction_folds_old_minutes_into_hours_and_keeps_every_token(store: Store) -> None:
    week = 7 * 86400
    now = 100 * 86400.0
    old = [row(3600 * 10 + 60 * m, tokens=m) for m in range(0, 60, 7)]  # an old hour's minutes
    recent = [row(int(now) - 120), row(int(now) - 60)]
    store.record_usage(UsageBatch("r", 1, (*old, *recent)))
    before = store.usage(*ALL, by=())
    folded = store.compact_usage(now=now)
    assert folded == len(old) - 1  # the minute starting the hour is the hour's row already
    assert store.usage(*ALL, by=()) == before
    assert [r["time"] for r in store.usage(0, now - week, by=(), step=60)] == [36000]
    assert store.compact_usage(now=now) == 0
    assert store.record_usage(UsageBatch("r", 1, (row(60),))) is False  # the seqs outlive compaction


def test_names_with_a_nul_are_stored_not_refused(store: Store) -> None:
    """A name off the wire may hold NUL (PostgreSQL's text cannot): the batch is recorded, so its
    router is acknowledged instead of resending it for ever."""
    assert store.record_usage(UsageBatch("r\x00", 1, (row(60, tenant="t\x00x"),))) is True
    (only,) = store.usage(*ALL, by=("tenant",))
    assert only["tenant"] in ("t\x00x", "t\ufffdx") and only["requests"] == 1
    event = store.add_event("k", "engine said \x00", "m")
    assert store.events() == [event]
