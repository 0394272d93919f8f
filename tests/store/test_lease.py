"""The leader lease (DESIGN §5), in either store: one holder at a time, decided by compare-and-swap
on the database's clock; epochs only grow; a release hands over at once; a holder whose lease
lapsed or was taken cannot renew it, and knows from its grant when it must have stopped.

No test assumes the machine's speed: a lease that must not lapse lasts minutes, and one that
must lapse is waited for (bounded), judging only what the database said."""

from __future__ import annotations

import threading
import time

import pytest

from llmgw.store.protocol import Store
from llmgw.store.records import LeaseGrant
from tests.store.conftest import Backend

LONG = 300.0  # a lease no test outlives


def wait_for_lease(store: Store, holder: str, *, ttl: float = LONG, within: float = 30.0) -> LeaseGrant:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        grant = store.acquire_lease(holder, ttl=ttl)
        if grant is not None:
            return grant
        time.sleep(0.05)
    raise AssertionError(f"{holder} did not get the lease within {within} s")


def test_the_first_holder_leads_and_the_others_are_refused(backend: Backend) -> None:
    a, b = backend.open(), backend.open()
    assert a.leadership().holder is None and a.leadership().epoch == 0 and a.leadership().leader is None
    grant = a.acquire_lease("ctl-a", ttl=LONG)
    assert grant is not None and grant.epoch == 1 and grant.ttl == LONG
    assert b.acquire_lease("ctl-b", ttl=LONG) is None
    assert a.acquire_lease("ctl-a", ttl=LONG) is None  # its own lease too: a leader renews
    seen = b.leadership()
    assert (seen.holder, seen.leader, seen.epoch, seen.expires) == ("ctl-a", "ctl-a", 1, grant.expires)
    assert seen.taken is not None and seen.taken <= seen.now < seen.expires
    assert seen.expires - seen.taken == pytest.approx(LONG, abs=1e-3)


def test_renewing_extends_the_lease_at_the_same_epoch(backend: Backend) -> None:
    a, b = backend.open(), backend.open()
    first = a.acquire_lease("ctl-a", ttl=60)
    assert first is not None
    renewed = a.renew_lease("ctl-a", first.epoch, ttl=LONG)
    assert renewed is not None and renewed.epoch == first.epoch and renewed.expires > first.expires
    assert b.leadership().expires == renewed.expires and b.leadership().renewed is not None
    assert b.renew_lease("ctl-b", first.epoch, ttl=LONG) is None  # not its lease
    assert a.renew_lease("ctl-a", first.epoch + 1, ttl=LONG) is None  # not its epoch
    assert b.leadership().expires == renewed.expires


def test_only_one_of_many_racing_holders_gets_the_lease(backend: Backend) -> None:
    stores = [backend.open() for _ in range(6)]
    grants: dict[str, LeaseGrant | None] = {}
    start = threading.Barrier(len(stores))

    def race(i: int, store: Store) -> None:
        start.wait(timeout=30)
        grants[f"ctl-{i}"] = store.acquire_lease(f"ctl-{i}", ttl=LONG)

    threads = [threading.Thread(target=race, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [h for h, g in grants.items() if g is not None]
    assert len(grants) == 6 and len(winners) == 1
    assert stores[0].leadership().holder == winners[0] and stores[0].leadership().epoch == 1


def test_expiry_is_judged_on_the_database_clock_not_the_callers(backend: Backend,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = backend.open(), backend.open()
    grant = a.acquire_lease("ctl-a", ttl=LONG)
    assert grant is not None
    # Callers whose clocks are a day ahead (or behind) change nothing: the database decides.
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 86400)
    assert b.acquire_lease("ctl-b", ttl=LONG) is None
    monkeypatch.setattr(time, "time", lambda: real() - 86400)
    assert a.renew_lease("ctl-a", grant.epoch, ttl=LONG) is not None
    monkeypatch.undo()
    # A short lease lapses by the database's clock: the next holder's lease begins no earlier
    # than the moment the first one's ended, as the database counted both.
    short = b.acquire_lease("ctl-b", ttl=LONG)
    assert short is None
    assert a.release_lease("ctl-a", grant.epoch)
    brief = a.acquire_lease("ctl-a", ttl=0.3)
    assert brief is not None
    taken = wait_for_lease(b, "ctl-b")
    assert b.leadership().taken >= brief.expires  # type: ignore[operator]
    assert taken.epoch == brief.epoch + 1


def test_a_release_hands_over_at_once_and_the_epoch_stays(backend: Backend) -> None:
    a, b = backend.open(), backend.open()
    grant = a.acquire_lease("ctl-a", ttl=LONG)
    assert grant is not None
    assert a.release_lease("ctl-a", grant.epoch) is True
    released = b.leadership()
    assert released.holder is None and released.leader is None and released.epoch == grant.epoch
    assert released.expires is not None and released.expires <= released.now
    taken = b.acquire_lease("ctl-b", ttl=LONG)  # at once: no waiting out the released lease
    assert taken is not None and taken.epoch == grant.epoch + 1
    assert a.release_lease("ctl-a", grant.epoch) is False  # not its lease any more: B keeps it
    assert a.renew_lease("ctl-a", grant.epoch, ttl=LONG) is None
    assert b.leadership().leader == "ctl-b"


def test_a_stale_holder_cannot_renew_or_release_the_lease_it_lost(backend: Backend) -> None:
    a, b = backend.open(), backend.open()
    lost = a.acquire_lease("ctl-a", ttl=0.3)
    assert lost is not None
    took = wait_for_lease(b, "ctl-b")  # A paused past its lease (a GC, a stalled disk, a partition)
    assert took.epoch == lost.epoch + 1
    assert a.renew_lease("ctl-a", lost.epoch, ttl=LONG) is None
    assert a.release_lease("ctl-a", lost.epoch) is False
    assert a.acquire_lease("ctl-a", ttl=LONG) is None
    now = a.leadership()
    assert (now.leader, now.epoch) == ("ctl-b", took.epoch)


def test_a_lapsed_lease_nobody_took_is_not_renewed_but_taken_again_at_a_new_epoch(backend: Backend) -> None:
    """Once its deadline passed the holder stopped acting: coming back is a new term."""
    a = backend.open()
    lapsed = a.acquire_lease("ctl-a", ttl=0.2)
    assert lapsed is not None
    again = wait_for_lease(a, "ctl-a")
    assert again.epoch == lapsed.epoch + 1
    assert a.renew_lease("ctl-a", lapsed.epoch, ttl=LONG) is None


def test_epochs_only_grow_over_acquires_releases_and_lapses(backend: Backend) -> None:
    stores = [backend.open(), backend.open()]
    epochs = []
    for i in range(6):
        store, holder = stores[i % 2], f"ctl-{i % 2}"
        # Released (a new holder takes it at once) or, after the short ones, lapsed (it waits).
        grant = wait_for_lease(store, holder, ttl=0.2 if i % 3 == 2 else LONG)
        epochs.append(grant.epoch)
        if i % 3 != 2:
            renewed = store.renew_lease(holder, grant.epoch, ttl=LONG)
            assert renewed is not None and renewed.epoch == grant.epoch
            assert store.release_lease(holder, grant.epoch)
    assert epochs == list(range(1, 7))


def test_a_grant_tells_its_holder_when_to_stop_acting(backend: Backend) -> None:
    store = backend.open()
    started = time.monotonic()
    grant = store.acquire_lease("ctl-a", ttl=15)
    assert grant is not None
    assert grant.deadline(started, margin=3) == pytest.approx(started + 12)
    seen = store.leadership()
    # The lease's remaining time on the database's clock is never less than what the holder counts
    # (less SQLite's clock resolution, a millisecond).
    left = seen.expires - seen.now  # type: ignore[operator]
    assert left >= grant.deadline(started, margin=0) - time.monotonic() - 0.002


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), float("nan")])
def test_a_lease_lasts_a_positive_finite_time(store: Store, ttl: float) -> None:
    with pytest.raises(ValueError, match="positive, finite"):
        store.acquire_lease("ctl-a", ttl=ttl)


def test_controllers_check_in_and_see_each_other_most_recent_first(backend: Backend,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = backend.open(), backend.open()
    first = a.check_in("ctl-a@http://10.0.0.11:8081", url="http://10.0.0.11:8081", role="leader")
    assert [(c.holder, c.url, c.role) for c in first] == [("ctl-a@http://10.0.0.11:8081", "http://10.0.0.11:8081",
                                                           "leader")]
    time.sleep(0.05)  # a later check-in on the database's clock
    seen = b.check_in("ctl-b", url=None, role="standby")
    assert [(c.holder, c.role) for c in seen] == [("ctl-b", "standby"), ("ctl-a@http://10.0.0.11:8081", "leader")]
    assert seen[0].age <= seen[1].age and all(c.age >= 0 for c in seen)
    # A new role replaces the old; a caller's clock decides nothing.
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 86400)
    again = a.check_in("ctl-a@http://10.0.0.11:8081", url="http://10.0.0.11:8081", role="standby")
    assert {c.holder: c.role for c in again} == {"ctl-a@http://10.0.0.11:8081": "standby", "ctl-b": "standby"}
    assert again[0].to_json()["role"] == "standby" and again[0].to_json()["seen_s_ago"] < 60


def test_a_controller_not_seen_for_long_is_forgotten(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    import llmgw.store.postgres
    import llmgw.store.sqlite

    a, b = backend.open(), backend.open()
    a.check_in("ctl-gone", url=None, role="standby")
    for module in (llmgw.store.sqlite, llmgw.store.postgres):
        monkeypatch.setattr(module, "FORGET_AFTER", 0.2)
    time.sleep(0.3)  # at least that long later, on any clock
    assert [c.holder for c in b.check_in("ctl-b", url=None, role="leader")] == ["ctl-b"]
