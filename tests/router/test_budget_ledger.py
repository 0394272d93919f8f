"""Budgets that a bad day cannot reset (issue 24): the controller's ledger says what each budget
used this period, and every router starts from it. A router restarted mid-period, a Redis that
lost its data, and Redis away (each router alone: only its share of what is left) keep a spent
tenant spent. Real SQLite store, real FeedHub over HTTP, real redis-server, the real openai client."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path

import openai
import pytest

from llmgw.catalog.model import Budget, Catalog, Limits, Settings, Tenant
from llmgw.contract import UsageBatch, UsageRow, period_start
from llmgw.control.feed import FeedHub
from llmgw.control.usage import BookedLedger, BudgetBook
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from llmgw.state import Store
from llmgw.tenancy.memory import Limiter, Ticket
from llmgw.tenancy.rules import Refusal
from tests.router.conftest import TOKEN, endpoint, router_metric, serving
from tests.router.fake_controller import make_app, model
from tests.router.test_feed import following, until
from tests.router.test_usage_ledger import serve

MESSAGES = [{"role": "user", "content": "Hello"}]
DAY = Budget(tokens=1_000, per="day")
KEYS = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])


@pytest.fixture(autouse=True)
def redis_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis gets 5 s a call instead of 0.25 s: on a busy machine a slower call is degraded mode,
    which the tests here assert only where Redis is gone (killed: refused at once)."""
    from llmgw.tenancy import shared as shared_limits

    monkeypatch.setattr(shared_limits, "TIMEOUT", 5.0)


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def row(minute: float, tenant: str, model_: str, prompt: int, completion: int) -> UsageRow:
    return UsageRow(int(minute) // 60 * 60, tenant, "k", model_, requests=1, prompt_tokens=prompt,
                    completion_tokens=completion)


def catalog(limits: Limits, models: tuple[tuple[str, Limits], ...] = ()) -> Catalog:
    return Catalog(models=(model("chat"),), settings=Settings(tenants=(Tenant("team", ("team-key",), limits, models),)))


# --- the controller's book ------------------------------------------------------------------------

async def test_the_book_reads_each_budget_period_from_the_ledger_then_follows_every_batch(tmp_path: Path) -> None:
    clock = [at("2026-12-03T12:00:00")]
    store = Store(tmp_path / "llmgw.db").open()
    store.record_usage(UsageBatch("r1", 1, (
        row(at("2026-12-02T23:00:00"), "team", "chat", 500, 500),  # yesterday: another period
        row(at("2026-12-03T01:00:00"), "team", "chat", 100, 200),
        row(at("2026-12-03T02:00:00"), "team", "embed", 10, 0),
        row(at("2026-12-03T03:00:00"), "other", "chat", 7, 7),
    )))
    book = BudgetBook(clock=lambda: clock[0])
    book.set_catalog(catalog(Limits(budget=DAY), (("chat", Limits(budget=Budget(tokens=500, per="month"))),)))
    assert not book.loaded and book.figures() == {}
    await book.load(store)
    day, month = period_start(DAY, clock[0]), at("2026-12-01T00:00:00")
    assert book.figures() == {("team", ""): (day, 310), ("team", "chat"): (month, 1300)}
    ledger = BookedLedger(store, book)
    batch = UsageBatch("r1", 2, (row(clock[0], "team", "chat", 1, 2), row(clock[0], "other", "chat", 1, 1)))
    assert ledger.record_usage(batch) and not ledger.record_usage(batch)  # once, as the ledger
    assert book.figures() == {("team", ""): (day, 313), ("team", "chat"): (month, 1303)}
    clock[0] = at("2026-12-04T00:00:01")  # the day's budget resets; the month's goes on
    assert book.figures() == {("team", ""): (day + 86_400, 0), ("team", "chat"): (month, 1303)}
    # A budget whose period changes is read again; one that only changed its size is not.
    book.set_catalog(catalog(Limits(budget=Budget(tokens=9, per="day")),
                             (("chat", Limits(budget=Budget(tokens=5, per="day"))),)))
    assert not book.loaded
    await book.load(store)
    assert book.figures() == {("team", ""): (day + 86_400, 0), ("team", "chat"): (day + 86_400, 0)}
    store.close()


async def test_rows_from_a_router_ahead_of_the_controller_count_in_the_current_period(tmp_path: Path) -> None:
    """Review 2: a router whose clock is a day ahead stamped its row in tomorrow's period, and the
    book moved the scope there: every router was then told (tomorrow, 30) instead of (today,
    830), and a Redis restarted empty handed the tenant a fresh budget. A row from the future
    counts in the controller's current period."""
    clock = [at("2026-12-03T12:00:00")]
    store = Store(tmp_path / "llmgw.db").open()
    book = BudgetBook(clock=lambda: clock[0])
    book.set_catalog(catalog(Limits(budget=DAY)))
    await book.load(store)
    ledger = BookedLedger(store, book)
    day = period_start(DAY, clock[0])
    ledger.record_usage(UsageBatch("good", 1, (row(clock[0], "team", "chat", 400, 400),)))
    ledger.record_usage(UsageBatch("ahead", 1, (row(clock[0] + 86_400, "team", "chat", 10, 20),)))
    assert book.figures() == {("team", ""): (day, 830)}
    clock[0] = at("2026-12-04T00:00:01")  # the controller's own day ends: the period does
    assert book.figures() == {("team", ""): (day + 86_400, 0)}
    store.close()


async def test_a_router_stamps_its_usage_on_the_shared_limits_clock(chat_sim: SimProcess) -> None:
    """Admission runs on Redis's clock; the usage rows are stamped on it too, so a router whose
    own clock is a day ahead reports today's use as today's."""
    port = free_port()
    redis = redis_server(port)
    try:
        r = Router(keys=KEYS, config=RouterConfig(limits_redis=f"redis://127.0.0.1:{port}/0"),
                   wall=lambda: time.time() + 86_400.0)
        r.set_catalog(catalog(Limits(budget=DAY)))
        r.set_endpoints([endpoint("chat", chat_sim.endpoint)])
        async with serving(r) as base, openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team",
                                                          max_retries=0, timeout=15) as c:
            await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5)
        batch = r.usage.outbox.take()
        assert batch is not None and batch.rows
        now = time.time()
        assert all(abs(x.minute - now) < 3_600 for x in batch.rows), [x.minute - now for x in batch.rows]
    finally:
        redis.kill()
        redis.wait(5)


# --- a router starts from the ledger -------------------------------------------------------------

async def test_a_router_restarted_mid_budget_starts_from_what_the_ledger_says(chat_sim: SimProcess,
                                                                               tmp_path: Path) -> None:
    """Through a real hub: the first router spends the budget and stops; a new router (a
    restart: its own counts are gone) refuses the tenant from its first request."""
    store = Store(tmp_path / "llmgw.db").open()
    book = BudgetBook()
    hub = FeedHub(keepalive=0.2)
    hub.ledger, hub.budgets = BookedLedger(store, book), book
    hub.set_catalog(catalog(Limits(budget=DAY)))
    book.set_catalog(catalog(Limits(budget=DAY)))
    await book.load(store)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    port = free_port()
    runner = await serve(make_app(hub, TOKEN), port)
    try:
        first = Router(keys=KEYS, config=RouterConfig())
        async with following(first, f"http://127.0.0.1:{port}"), serving(first) as base:
            await until(lambda: first.table.has("chat"))
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15) as c:
                with pytest.raises(openai.RateLimitError):
                    for _ in range(100):
                        await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=100)
        spent = book.figures()[("team", "")][1]
        assert spent > DAY.tokens - 110  # the router's last batch went with it
        second = Router(keys=KEYS, config=RouterConfig())
        async with following(second, f"http://127.0.0.1:{port}"), serving(second) as base:
            await until(lambda: second.table.has("chat"))
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15) as c:
                with pytest.raises(openai.RateLimitError) as refused:
                    await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=100)
        assert f"has used {spent} of its 1000-token budget" in refused.value.message
    finally:
        await runner.cleanup()
        store.close()


def test_a_router_counts_the_most_it_knows_of_and_degraded_grants_only_its_share() -> None:
    now = at("2026-12-03T12:00:00")
    day = period_start(DAY, now)
    lim = Limiter([Tenant("team", ("k",), Limits(budget=DAY))])
    lim.set_spent({("team", ""): (day, 900)}, routers=3)
    assert isinstance(lim.admit("k", ("m",), 101, now), Refusal)
    # Figures that leave the budget out (a new leader that has not read it yet) keep its figure:
    # taken for "nothing spent", every router granted the budget again meanwhile.
    lim.set_spent({}, routers=3)
    assert isinstance(lim.admit("k", ("m",), 101, now), Refusal)
    t = lim.admit("k", ("m",), 100, now)
    assert isinstance(t, Ticket)
    t.settle(100)
    t.release()
    lim.set_spent({("team", ""): (day - 86_400, 900)}, routers=3)  # yesterday's figure: not this period's
    assert lim.scopes_of("k", ("m",))[0].spent() == 100  # type: ignore[index]
    # Redis away: what Redis last said (600 used or reserved) against the ledger's 400: the most
    # is taken, and this router grants a third of the 400 left.
    lim = Limiter([Tenant("team", ("k",), Limits(budget=DAY))])
    lim.set_spent({("team", ""): (day, 400)}, routers=3)
    lim.degrade({"team": (day, 600)}, now)
    granted = 0
    while isinstance(t := lim.admit("k", ("m",), 10, now), Ticket):
        t.settle(10)
        t.release()
        granted += 10
    assert granted == 130 and "its share of 3 routers" in t.message
    lim.undegrade()
    assert isinstance(lim.admit("k", ("m",), 10, now), Ticket)  # counted in Redis again


# --- Redis restarted without its data, and Redis away -----------------------------------------------

pytest_redis = pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")


def redis_server(port: int) -> subprocess.Popen:
    import socket

    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--daemonize", "no"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)


def shared_router(engine_url: str, url: str, limits: Limits) -> Router:
    r = Router(keys=KEYS, config=RouterConfig(limits_redis=url))
    r.set_catalog(catalog(limits))
    r.set_endpoints([endpoint("chat", engine_url)])
    return r


async def spend(base: str, max_tokens: int = 50) -> int:
    """Requests until refused; the tokens they were served."""
    served = 0
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15) as c:
        while True:
            try:
                r = await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=max_tokens)
            except openai.RateLimitError as exc:
                assert "budget" in exc.message, exc.message
                return served
            served += r.usage.total_tokens


@pytest_redis
async def test_a_redis_restarted_without_its_data_starts_from_the_ledger(chat_sim: SimProcess) -> None:
    port = free_port()
    redis = redis_server(port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        routers = [shared_router(chat_sim.endpoint, url, Limits(budget=DAY)) for _ in range(2)]
        async with AsyncExitStack() as stack:
            bases = [await stack.enter_async_context(serving(r)) for r in routers]
            served = await spend(bases[0])
            assert DAY.tokens - 100 < served <= DAY.tokens  # short of it by less than a reservation (50 + prompt)
            figures = {("team", ""): (period_start(DAY, time.time()), served)}  # the ledger, as reported
            for r in routers:
                r.set_spent(figures, 2)
            redis.kill()
            redis.wait(5)
            redis = redis_server(port)  # empty: no persistence
            # No fresh budget: what is served after is within what was left (by the grant's floor
            # or degraded mode). Not necessarily nothing: a router still holds the allowance the
            # lost Redis granted it, and may serve one more request from it and the floor's rest.
            after = [await spend(base) for base in bases]
            assert served + sum(after) <= DAY.tokens, (served, after)
            assert sum(after) < 100  # at most one request (a reservation: 50 + its prompt)
            for r in routers:
                assert router_metric(r, "llmgw_router_limits_degraded") == 0  # Redis answered
            # The router that had not used Redis before it went away asked the new one: it says so too.
            import redis as redis_client

            with redis_client.Redis.from_url(url) as db:
                keys = [k for k in db.scan_iter("llmgw:limits:team:budget:*")]
                assert keys and int(db.hget(keys[0], "used") or 0) >= served
    finally:
        redis.kill()
        redis.wait(5)


@pytest_redis
async def test_with_redis_away_three_routers_grant_no_more_than_what_was_left(chat_sim: SimProcess) -> None:
    """Each router alone used to grant a whole fresh budget (3 routers, 3 budgets). Now each
    goes on from the ledger's figure and grants a third of what was left."""
    port = free_port()
    redis = redis_server(port)
    url = f"redis://127.0.0.1:{port}/0"
    budget = Budget(tokens=3_000, per="day")
    try:
        routers = [shared_router(chat_sim.endpoint, url, Limits(budget=budget)) for _ in range(3)]
        async with AsyncExitStack() as stack:
            bases = [await stack.enter_async_context(serving(r)) for r in routers]
            async with openai.AsyncOpenAI(base_url=bases[0] + "/v1", api_key="sk-team", max_retries=0,
                                          timeout=15) as c:
                used = 0
                while used < 1_500:
                    r = await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=100)
                    used += r.usage.total_tokens
            # The routers' syncs (each within SYNC_EVERY): what they held is given back, only the used
            # stays. Seen in Redis, not waited out.
            import redis as redis_client

            with redis_client.Redis.from_url(url) as db:
                key = f"llmgw:limits:team:budget:{int(period_start(budget, time.time()))}"
                deadline = time.monotonic() + 30  # a bound on a hang
                while int(db.hget(key, "reserved") or 0) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert int(db.hget(key, "reserved") or 0) == 0
            figures = {("team", ""): (period_start(budget, time.time()), used)}
            for r in routers:
                r.set_spent(figures, 3)
            redis.kill()
            redis.wait(5)
            served = [await spend(base, max_tokens=20) for base in bases]
            for r in routers:
                assert router_metric(r, "llmgw_router_limits_degraded") == 1
        left = budget.tokens - used
        assert sum(served) <= left and all(s <= left // 3 for s in served), (served, left)
        assert sum(served) > left // 2  # and the routers did grant their shares
    finally:
        redis.kill()
        redis.wait(5)


def test_one_router_count_for_every_router_and_a_larger_one_shrinks_a_degraded_share() -> None:
    """Routers told 3 and 4 at different moments granted 12 % past a budget (issue 39): the
    controller tells every router the most it has heard from at once (or the configured count),
    and a router degraded with a share for 3 that then hears of 4 grants a quarter, never more."""
    heard = 3
    hub = FeedHub(local_routers=1)
    hub.routers = lambda: {f"r{i}": 0.0 for i in range(heard)}  # type: ignore[method-assign]
    assert hub.router_count() == 4  # three standalone routers and the controller's own
    heard = 1  # two went quiet (cut off, perhaps, and granting alone)
    assert hub.router_count() == 4
    hub.configured_routers = 6  # router.limits_routers
    assert hub.router_count() == 6

    budget = Budget(tokens=1_200, per="day")
    limiter = Limiter([Tenant("team", ("k",), Limits(budget=budget))])
    limiter.set_spent({}, routers=3)
    limiter.degrade({}, 1000.0)
    [scope] = [s for s in limiter.scopes() if s.limits.budget is not None]
    assert scope.share == 400
    limiter.set_spent({}, routers=4)
    assert scope.share == 300
    limiter.set_spent({}, routers=2)
    assert scope.share == 300  # a smaller count never hands out more


@pytest_redis
async def test_allowances_of_a_redis_that_lost_its_data_are_not_admitted_from_again(chat_sim: SimProcess) -> None:
    """Redis restarted empty between two calls of the routers (none saw it away): the allowances
    the lost Redis granted are dropped, not spent on top of what the new one grants from the
    ledger (seen: 21,267 of 20,000 tokens). Overshoot at most a request per router."""
    port = free_port()
    redis = redis_server(port)
    url = f"redis://127.0.0.1:{port}/0"
    budget = Budget(tokens=20_000, per="day")
    try:
        routers = [shared_router(chat_sim.endpoint, url, Limits(budget=budget)) for _ in range(2)]
        async with AsyncExitStack() as stack:
            bases = [await stack.enter_async_context(serving(r)) for r in routers]
            used = 0
            async with AsyncExitStack() as clients:
                cs = [await clients.enter_async_context(openai.AsyncOpenAI(
                    base_url=b + "/v1", api_key="sk-team", max_retries=0, timeout=15)) for b in bases]
                for _ in range(20):  # both routers busy: each holds an allowance topped up by its pace
                    for c in cs:
                        r = await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=100)
                        used += r.usage.total_tokens
            held = [sum(a.budget for a in r._admission.limits._allowances.values()) for r in routers]  # noqa: SLF001
            assert all(h > 0 for h in held), held  # what the lost Redis will have granted them
            figures = {("team", ""): (period_start(budget, time.time()), used)}  # the ledger, as reported
            for r in routers:
                r.set_spent(figures, 2)
            redis.kill()
            redis.wait(5)
            redis = redis_server(port)  # empty: no persistence, and up before any router called
            after = [await spend(base, max_tokens=100) for base in bases]
            reservation = 100 + 20  # max_tokens and the prompt's estimate
            assert used + sum(after) <= budget.tokens + 2 * reservation, (used, after, held)
            assert sum(getattr(r._admission.limits, "lost_data", 0) for r in routers) >= 1  # noqa: SLF001 - and said
    finally:
        redis.kill()
        redis.wait(5)
