"""The leader loop (llmgw.control.leadership) on a real PostgreSQL store: one of two leads; a
graceful close hands over at once; a leader cut off from the store stops acting before its lease
can be taken; epochs grow. Timing knobs are short, and every wait is bounded."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from llmgw.control.leadership import LEADER, STANDBY, Leadership, LeadershipConfig, advertised_url, holder_id
from llmgw.store.postgres import PostgresStore
from llmgw.store.protocol import Store
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures for this module

FAST = LeadershipConfig(ttl=3.0, renew=0.3, retry=0.1, margin=1.0)
# For what must not lapse: a stall of seconds on a busy machine cannot lose this lease, so a
# handover well under its TTL is a release, not a lapse.
STEADY = LeadershipConfig(ttl=30.0, renew=0.3, retry=0.1, margin=5.0)


class Log:
    """What one controller's callbacks saw, with the monotonic time of each."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int | None, float]] = []

    async def lead(self, epoch: int) -> None:
        self.events.append(("lead", epoch, time.monotonic()))

    async def standby(self) -> None:
        self.events.append(("standby", None, time.monotonic()))


class Partitioned:
    """A store whose calls hang once ``cut`` is set, as behind a dead network path (the real
    store's own timeouts would end them later; this one ends them only when healed)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.cut = threading.Event()
        self.healed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.cut.is_set():
                self.healed.wait(30)
            return attr(*args, **kwargs)
        return call


async def until(check: Callable[[], bool], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
def stores(postgres_url: str) -> Iterator[Callable[[], PostgresStore]]:  # noqa: F811
    opened: list[PostgresStore] = []

    def make() -> PostgresStore:
        store = PostgresStore(postgres_url).open()
        opened.append(store)
        return store
    yield make
    for s in opened:
        s.close()


def test_a_holder_id_carries_the_advertised_url_and_is_unique() -> None:
    a, b = holder_id("http://ctl-a:8081"), holder_id("http://ctl-a:8081")
    assert a != b and advertised_url(a) == "http://ctl-a:8081"
    assert advertised_url(holder_id(None)) is None and advertised_url(None) is None
    with pytest.raises(ValueError):
        LeadershipConfig(ttl=1.0, renew=1.0)


async def test_one_of_two_leads_and_a_close_hands_over_at_once(stores: Callable[[], PostgresStore]) -> None:
    la, lb = Log(), Log()
    a = Leadership(stores(), url="http://a", on_lead=la.lead, on_standby=la.standby, config=STEADY)
    b = Leadership(stores(), url="http://b", on_lead=lb.lead, on_standby=lb.standby, config=STEADY)
    await a.start()
    await until(lambda: a.leading)
    await b.start()
    await until(lambda: b.seen is not None and b.seen.leader == a.holder)
    await asyncio.sleep(4.5)  # a renews, about fifteen times: b never takes over
    assert a.role == LEADER and b.role == STANDBY and not lb.events
    assert b.leader_url == "http://a" and a.leader_url == "http://a"
    assert b.summary()["leader"] == a.holder and b.summary()["epoch"] == a.epoch == 1
    closed = time.monotonic()
    await a.close()
    await until(lambda: bool(lb.events), within=15)  # at once: not after a's lease lapsed
    assert time.monotonic() - closed < STEADY.ttl
    assert b.epoch == 2 and lb.events[0][:2] == ("lead", 2)
    assert la.events == [("lead", 1, la.events[0][2])]  # close() runs no callback
    await b.close()


async def test_a_leader_cut_off_from_the_store_stops_before_its_lease_can_be_taken(
        stores: Callable[[], PostgresStore]) -> None:
    la, lb = Log(), Log()
    cut = Partitioned(stores())
    a = Leadership(cut, url="http://a", on_lead=la.lead, on_standby=la.standby, config=FAST)  # type: ignore[arg-type]
    b = Leadership(stores(), url="http://b", on_lead=lb.lead, on_standby=lb.standby, config=FAST)
    await a.start()
    await until(lambda: a.leading)
    await b.start()
    await asyncio.sleep(0.5)
    cut.cut.set()
    await until(lambda: bool(lb.events), within=FAST.ttl * 4)
    assert [e[0] for e in la.events] == ["lead", "standby"]
    stood_down, took = la.events[1][2], lb.events[0][2]
    assert stood_down < took, "the cut-off leader still acted when the other took the lease"
    assert not a.leading and b.epoch == 2
    # Its own lapsed lease is the last it read: it names no leader rather than itself (routers it
    # sent back to itself were refused again until it read the store).
    assert a.leader_url is None and a.summary()["leader"] is None
    cut.healed.set()
    await until(lambda: a.seen is not None and a.seen.leader == b.holder)
    assert a.role == STANDBY and a.leader_url == "http://b"
    await a.close()
    await b.close()


async def test_epochs_grow_across_leaders(stores: Callable[[], PostgresStore]) -> None:
    epochs = []
    for _ in range(3):
        log = Log()
        one = Leadership(stores(), url=None, on_lead=log.lead, on_standby=log.standby, config=FAST)
        await one.start()
        await until(lambda one=one: one.leading)  # type: ignore[misc]
        epochs.append(one.epoch)
        await one.close()
    assert epochs == [1, 2, 3]
