"""The usage ledger (issue 18): routers' usage reaches the controller's store exactly once, however
reports are lost, resent or cut off, with the real openai client, real simulated engines, a real
FeedHub over HTTP and a real SQLite store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from aiohttp import web

from llmgw.catalog.model import Catalog, Limits, Settings, Tenant
from llmgw.contract import MAX_USAGE_ROWS, REPORT_PATH, UsageBatch, UsageRow
from llmgw.control.feed import FeedHub
from llmgw.control.usage import GatedLedger
from llmgw.decide.usage_gate import FLOOR
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from llmgw.state import Store
from llmgw.tenancy.usage import Usage, UsageOutbox
from tests.router.conftest import TOKEN, client, endpoint, serving
from tests.router.fake_controller import make_app, model
from tests.router.test_feed import following, until

HELLO = [{"role": "user", "content": "count to five"}]
KEYS = KeyRing.from_entries([{"name": "ci", "sha256": hash_key("sk-ci"), "models": ["*"]},
                             {"name": "web", "sha256": hash_key("sk-web"), "models": ["*"]}])
CATALOG = Catalog(models=(model("chat"),),
                  settings=Settings(tenants=(Tenant("search", ("web",), Limits()), Tenant("batch", ("ci",), Limits()))))


def totals(store: Store, **where: str) -> dict[str, int]:
    rows = store.usage(0, 2 ** 40, by=(), where=where)
    return {k: v for k, v in rows[0].items()} if rows else {}


# --- the pure handshake ---------------------------------------------------------------------

def test_a_batch_is_sent_again_until_acknowledged_and_what_came_since_waits() -> None:
    box = UsageOutbox("r-1")
    assert box.take() is None
    box.add(60, "t", "k", "m", Usage(requests=1, prompt_tokens=5, completion_tokens=7))
    first = box.take()
    assert first is not None and first.seq == 1 and first.rows[0].completion_tokens == 7
    box.add(60, "t", "k", "m", Usage(requests=1, prompt_tokens=1, completion_tokens=1))
    assert box.take() is first  # not acknowledged: the very same batch, not a bigger one
    box.acked(99)  # an answer about another batch changes nothing
    assert box.take() is first
    box.acked(1)
    second = box.take()
    assert second is not None and second.seq == 2 and second.rows[0].prompt_tokens == 1
    box.acked(2)
    assert box.take() is None and box.pending == 0


def test_the_store_records_each_batch_once_and_keeps_it_across_a_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "llmgw.db").open()
    batch = UsageBatch("r-1", 1, (UsageRow(120, "search", "web", "chat", 2, 0, 10, 20, 0),
                                   UsageRow(180, "search", "web", "chat", 1, 1, 0, 3, 1)))
    assert store.record_usage(batch) is True
    assert store.record_usage(batch) is False  # resent after a lost answer
    assert store.record_usage(UsageBatch("r-1", 1, batch.rows[:1])) is False  # any batch with that seq
    store.close()
    store = Store(tmp_path / "llmgw.db").open()
    assert store.record_usage(batch) is False  # a restarted controller still knows it
    assert totals(store) == {"requests": 3, "errors": 1, "prompt_tokens": 10, "completion_tokens": 23,
                             "counted_from_stream": 1, "refused": 0}
    assert store.record_usage(UsageBatch("r-2", 1, batch.rows[:1]))  # another router's first batch
    assert [r["requests"] for r in store.usage(0, 2 ** 40, by=("tenant",), step=60)] == [4, 1]
    assert store.usage(121, 180, by=("key",)) == []  # minutes are counted whole, from their start
    store.close()


def test_old_minutes_are_summed_into_hours_and_nothing_is_lost(tmp_path: Path) -> None:
    store = Store(tmp_path / "llmgw.db").open()
    day = 86400 * 100
    rows = tuple(UsageRow(day + m * 60, "t", "k", "chat", 1, 0, m, 1, 0) for m in range(150))
    store.record_usage(UsageBatch("r", 1, rows))
    before = totals(store)
    assert store.compact_usage(now=day + 30 * 86400) == 147  # the minutes that do not start an hour
    assert totals(store) == before
    assert [r["time"] for r in store.usage(0, 2 ** 40, by=(), step=3600)] == [day, day + 3600, day + 7200]
    assert store.compact_usage(now=day + 30 * 86400) == 0
    store.close()


# --- over the wire ------------------------------------------------------------------------------

async def serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    return runner


async def ask(c: openai.AsyncOpenAI, stream: bool) -> tuple[int, int]:
    """One request; the (prompt, completion) tokens the client was told it used."""
    if not stream:
        r = await c.chat.completions.create(model="chat", messages=HELLO, max_tokens=6)
        assert r.usage is not None
        return r.usage.prompt_tokens, r.usage.completion_tokens
    s = await c.chat.completions.create(model="chat", messages=HELLO, max_tokens=6, stream=True,
                                        stream_options={"include_usage": True})
    usage = None
    async for chunk in s:
        usage = chunk.usage or usage
    assert usage is not None
    return usage.prompt_tokens, usage.completion_tokens


async def test_a_lost_answer_to_a_report_counts_nothing_twice(chat_sim: SimProcess, tmp_path: Path) -> None:
    store = Store(tmp_path / "llmgw.db").open()
    hub = FeedHub(keepalive=0.2)
    hub.ledger = store
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    app = make_app(hub, TOKEN)
    dropped = []

    @web.middleware
    async def lose_answers(request: web.Request, handler):  # noqa: ANN001, ANN202 - aiohttp middleware
        resp = await handler(request)
        if request.path == REPORT_PATH and len(dropped) < 3 and b"usage_acked" in resp.body:
            dropped.append(resp.body)  # recorded, but the router never hears so
            raise ConnectionResetError("answer lost")
        return resp

    app.middlewares.append(lose_answers)
    router = Router(keys=KEYS, config=RouterConfig())
    port = free_port()
    runner = await serve(app, port)
    try:
        async with following(router, f"http://127.0.0.1:{port}"), serving(router) as base:
            await until(lambda: router.table.has("chat"))
            sent = [0, 0]
            async with client(base, "sk-web") as web_c, client(base, "sk-ci") as ci_c:
                for i in range(12):
                    p, c = await ask(web_c if i % 3 else ci_c, stream=i % 2 == 1)
                    sent[0] += p
                    sent[1] += c
                    await asyncio.sleep(0.03)
            await until(lambda: router.usage.outbox.pending == 0 and len(dropped) == 3, timeout=10)
            got = totals(store)
            assert (got["prompt_tokens"], got["completion_tokens"], got["requests"]) == (sent[0], sent[1], 12)
            assert totals(store, tenant="batch")["requests"] == 4 and totals(store, key="web")["requests"] == 8
    finally:
        await runner.cleanup()
        store.close()


async def test_a_router_stopping_sends_its_last_usage_and_a_controller_away_loses_none(
        chat_sim: SimProcess, tmp_path: Path) -> None:
    store = Store(tmp_path / "llmgw.db").open()
    port = free_port()

    def hub() -> FeedHub:
        h = FeedHub(keepalive=0.2)
        h.ledger = store
        h.set_catalog(CATALOG)
        h.set_endpoints([endpoint("chat", chat_sim.endpoint)])
        return h

    router = Router(keys=KEYS, config=RouterConfig())
    sent = [0, 0]
    async with serving(router) as base, client(base, "sk-web") as c:
        async with following(router, f"http://127.0.0.1:{port}") as feed:
            runner = await serve(make_app(hub(), TOKEN), port)
            await until(lambda: router.table.has("chat"))
            await runner.cleanup()  # the controller goes away; the router serves on and keeps counting
            await until(lambda: not feed.connected)
            for i in range(6):
                p, n = await ask(c, stream=i % 2 == 0)
                sent[0], sent[1] = sent[0] + p, sent[1] + n
            assert totals(store).get("requests", 0) < 6
            runner = await serve(make_app(hub(), TOKEN), port)  # a restarted controller, the same store
            await until(lambda: router.usage.outbox.pending == 0, timeout=10)
            # The last answers before a stop: sent by the feed's close, not lost with the process.
            for _ in range(3):
                p, n = await ask(c, stream=False)
                sent[0], sent[1] = sent[0] + p, sent[1] + n
        await runner.cleanup()
    got = totals(store)
    assert (got["requests"], got["prompt_tokens"], got["completion_tokens"]) == (9, *sent)
    store.close()


def test_a_batch_holds_at_most_max_usage_rows_and_the_rest_follows() -> None:
    box = UsageOutbox("r-1")
    for i in range(MAX_USAGE_ROWS + 500):
        box.add(60 * (i + 1), "t", f"k{i % 7}", "m", Usage(requests=1, completion_tokens=2))
    first = box.take()
    assert first is not None and len(first.rows) == MAX_USAGE_ROWS
    assert [r.minute for r in first.rows] == [60 * (i + 1) for i in range(MAX_USAGE_ROWS)]  # oldest first
    box.acked(first.seq)
    second = box.take()
    assert second is not None and len(second.rows) == 500 and box.pending == 500
    box.acked(second.seq)
    assert box.take() is None


async def test_usage_the_controller_cannot_keep_costs_neither_the_report_nor_the_other_keys(
        chat_sim: SimProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A key name too long for the ledger (the router took it; the controller cannot store it):
    its rows are refused and said so, the other key's usage and the router's report are kept, and
    nothing is sent again for ever."""
    long_name = "k" * 300
    keys = KeyRing.from_entries([{"name": "web", "sha256": hash_key("sk-web"), "models": ["*"]},
                                 {"name": long_name, "sha256": hash_key("sk-long"), "models": ["*"]}])
    store = Store(tmp_path / "llmgw.db").open()
    hub = FeedHub(keepalive=0.2)
    hub.ledger = store
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    router = Router(keys=keys, config=RouterConfig())
    port = free_port()
    runner = await serve(make_app(hub, TOKEN), port)
    try:
        async with following(router, f"http://127.0.0.1:{port}"), serving(router) as base:
            await until(lambda: router.table.has("chat"))
            async with client(base, "sk-web") as web_c, client(base, "sk-long") as long_c:
                told = await ask(web_c, stream=False)
                await ask(long_c, stream=True)
            await until(lambda: router.usage.outbox.pending == 0, timeout=10)
            assert len(hub.routers()) == 1  # its report was taken
    finally:
        await runner.cleanup()
    got = totals(store)
    store.close()
    assert (got["requests"], got["prompt_tokens"], got["completion_tokens"]) == (1, *told)
    assert "1 of 2 rows" in caplog.text and "at most 256 characters" in caplog.text


async def test_odd_reports_are_refused_in_words_and_odd_batches_are_not_sent_again(tmp_path: Path) -> None:
    """Numbers too big for SQLite or a float, a lone surrogate, a batch that is not one: the
    report answers 400 naming it, or (the batch alone is wrong) 200 with ``usage_rejected``."""
    import aiohttp

    store = Store(tmp_path / "llmgw.db").open()
    hub = FeedHub()
    hub.ledger = store
    port = free_port()
    runner = await serve(make_app(hub, TOKEN), port)
    row = {"minute": 60, "tenant": "t", "key": "k", "model": "m", "requests": 1}
    cases = [
        ({"router_id": "r", "demand": {"m": {"held": float("inf")}}}, 400, None),
        ({"router_id": "r", "usage": {"instance": "i", "seq": 2 ** 70, "rows": [row]}}, 200, 2 ** 70),
        ({"router_id": "r", "usage": {"instance": "\ud800", "seq": 3, "rows": [row]}}, 200, 3),
        ({"router_id": "r", "usage": {"instance": "i", "seq": 4, "rows": "all"}}, 200, 4),
        ({"router_id": "r", "usage": {"instance": "i", "seq": 5, "rows": [{**row, "key": "\udfff"},
                                                                          {**row, "requests": 2 ** 41}]}}, 200, None),
    ]
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
            for body, status, rejected in cases:
                raw = json.dumps(body).encode()  # inf and lone surrogates as JSON writes them
                async with s.post(f"http://127.0.0.1:{port}{REPORT_PATH}", data=raw,
                                  headers={"Content-Type": "application/json"}) as r:
                    answer = await r.json()
                    assert r.status == status, (body, answer)
                    if status == 400:
                        assert "malformed router report" in answer["error"]
                    else:
                        assert answer.get("usage_rejected") == rejected, (body, answer)
    finally:
        await runner.cleanup()
    assert not totals(store).get("requests")  # nothing of it was kept
    store.close()


def test_a_ledger_query_does_not_wait_for_the_writer(tmp_path: Path) -> None:
    """A long query (a year of rows, in a thread) must not hold what routers' reports, recorded
    on the controller's event loop, wait for; nor a write in progress hold up a query."""
    store = Store(tmp_path / "llmgw.db").open()
    store.record_usage(UsageBatch("r-1", 1, (UsageRow(120, "search", "web", "chat", 2, 0, 10, 20, 0),)))
    import threading

    got: list[dict[str, int]] = []
    with store._lock:  # the writer's lock, as a report being recorded holds it
        reader = threading.Thread(target=lambda: got.append(totals(store)), daemon=True)
        reader.start()
        reader.join(30)
        answered = not reader.is_alive()
    reader.join(5)
    assert answered and got[0]["requests"] == 2
    store.close()


class StoreAway:
    """The store as a database that went away: each record_usage fails with the store's own error
    until ``back`` is set (what a PostgreSQL store raises when the server restarts)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.back = asyncio.Event()
        self.failed = 0

    def record_usage(self, batch: UsageBatch) -> None:
        if not self.back.is_set():
            from llmgw.errors import StoreError

            self.failed += 1
            raise StoreError("the database is away (test)")
        self.store.record_usage(batch)

    def __getattr__(self, name: str):  # noqa: ANN204 - the rest of the store as it is
        return getattr(self.store, name)


async def test_a_store_away_costs_neither_the_report_nor_a_token(chat_sim: SimProcess, tmp_path: Path) -> None:
    # Seen: the report caught only sqlite3's errors, and the store raises its own (StoreError):
    # a database away answered the router's report with a 500 and the flush loop died.
    store = Store(tmp_path / "llmgw.db").open()
    away = StoreAway(store)
    hub = FeedHub(keepalive=0.2)
    hub.ledger = away  # type: ignore[assignment]
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    app = make_app(hub, TOKEN)
    statuses: list[int] = []

    @web.middleware
    async def status_of_reports(request: web.Request, handler):  # noqa: ANN001, ANN202 - aiohttp middleware
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            resp = exc
        except Exception:
            statuses.append(500)
            raise
        if request.path == REPORT_PATH:
            statuses.append(resp.status)
        return resp

    app.middlewares.append(status_of_reports)
    router = Router(keys=KEYS, config=RouterConfig())
    port = free_port()
    runner = await serve(app, port)
    try:
        async with following(router, f"http://127.0.0.1:{port}"), serving(router) as base:
            await until(lambda: router.table.has("chat"))
            async with client(base, "sk-web") as web_c:
                told = await ask(web_c, stream=False)
            await until(lambda: away.failed >= 2, timeout=10)  # sent, refused, sent again
            assert router.usage.outbox.pending > 0 and len(hub.routers()) == 1  # the report itself was taken
            away.back.set()
            await until(lambda: router.usage.outbox.pending == 0, timeout=10)
    finally:
        await runner.cleanup()
    got = totals(store)
    store.close()
    assert (got["requests"], got["prompt_tokens"], got["completion_tokens"]) == (1, *told)
    assert statuses and set(statuses) == {200}, statuses  # every report answered, none a 500


async def test_a_controller_restored_from_an_older_copy_gets_the_batches_it_lost(
        chat_sim: SimProcess, tmp_path: Path) -> None:
    # Seen (bench/ha_bench.py): a controller started on an older copy of its data dir lacked every
    # batch acknowledged since the copy (1,059 requests in one run), and budgets would grant that
    # use again. Its first report from a router that has batches beyond what the store knows asks
    # for them again; the router still keeps them and sends them in order.
    import sqlite3

    store = Store(tmp_path / "live" / "llmgw.db").open()
    hub = FeedHub(keepalive=0.2)
    hub.ledger = store
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    router = Router(keys=KEYS, config=RouterConfig())
    port = free_port()
    runner = await serve(make_app(hub, TOKEN), port)
    sent = [0, 0, 0]
    try:
        async with following(router, f"http://127.0.0.1:{port}"), serving(router) as base, \
                client(base, "sk-web") as web_c:
            async def some(n: int) -> None:
                for i in range(n):
                    p, c = await ask(web_c, stream=i % 2 == 1)
                    sent[0] += 1
                    sent[1] += p
                    sent[2] += c
                    await until(lambda: router.usage.outbox.pending == 0, timeout=10)  # a batch each

            await until(lambda: router.table.has("chat"))
            await some(2)
            (tmp_path / "copy").mkdir()
            with sqlite3.connect(tmp_path / "live" / "llmgw.db") as live, \
                    sqlite3.connect(tmp_path / "copy" / "llmgw.db") as copy:
                live.backup(copy)  # what a backup of the data dir holds (WAL included)
            await some(3)  # acknowledged by the live store, which is then lost
            restored = Store(tmp_path / "copy" / "llmgw.db").open()
            hub.ledger = restored
            await some(2)
            await until(lambda: router.usage.outbox.pending == 0, timeout=10)
    finally:
        await runner.cleanup()
    got = totals(restored)
    restored.close()
    store.close()
    assert (got["requests"], got["prompt_tokens"], got["completion_tokens"]) == tuple(sent)


@pytest.mark.parametrize("reads_now", [True, False], ids=["read-at-once", "held-until-the-next-reading"])
async def test_a_batch_past_the_last_engine_reading_is_recorded_even_as_its_router_stops(
        chat_sim: SimProcess, tmp_path: Path, reads_now: bool) -> None:
    """Behind the usage gate (issue 41) a standalone router's batch may come before the controller's
    own router read the tokens it counts. The controller reads the model's engines at once rather
    than hold the batch (here its router reads on its own only once an hour); where it cannot (no
    reader), the batch waits for the next reading and a stopping router keeps sending it meanwhile.
    Either way a router that stops right after its last answers loses none of them: the ledger
    equals what the clients were told. A CI run lost a quarter of a failover test's usage this way:
    held batches, and routers that stopped after two tries."""
    store = Store(tmp_path / "llmgw.db").open()
    # The controller's own router, which reads the engines.
    ctl_router = Router(keys=KEYS, config=RouterConfig(load_interval=3600 if reads_now else 2.0))
    ctl_router.set_catalog(CATALOG)
    ctl_router.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    hub = FeedHub(keepalive=0.2)
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    gated = GatedLedger(store, ctl_router.usage.engine_tokens, models=lambda: {"chat"})
    hub.ledger = gated
    hub.read_engines = ctl_router.usage.engine_tokens_now if reads_now else None
    router = Router(keys=KEYS, config=RouterConfig())
    port = free_port()
    runner = await serve(make_app(hub, TOKEN), port)
    sent = [0, 0]
    try:
        async with serving(ctl_router):
            await until(lambda: ctl_router.usage.engine_tokens())  # a reading before any answer
            # The controller's own router's answers, taken as they come, leave no room for more
            # than what the engine will count from now on (the engine may have served before).
            _model, prompted, generated = ctl_router.usage.engine_tokens()["chat-g1"]
            assert prompted is not None and generated is not None
            before = (int(prompted) + FLOOR, int(generated) + FLOOR)
            own = UsageBatch("own/1", 1, (UsageRow(600, "search", "web", "chat", requests=1, prompt_tokens=before[0],
                                                   completion_tokens=before[1]),))
            assert gated.trusted.record_usage(own)
            async with serving(router) as base, client(base, "sk-web") as c:
                async with following(router, f"http://127.0.0.1:{port}"):
                    await until(lambda: router.table.has("chat"))
                    for i in range(4):
                        p, n = await ask(c, stream=i % 2 == 0)
                        sent[0], sent[1] = sent[0] + p, sent[1] + n
                # stopped: whatever its reports had not delivered went with the follower's close
        got = totals(store, key="web")
        assert (got["requests"], got["prompt_tokens"], got["completion_tokens"]) == (5, before[0] + sent[0],
                                                                                     before[1] + sent[1])
        assert gated.gate.dropped == {} and gated.gate.held_tokens(0) == {}
    finally:
        await runner.cleanup()
        store.close()


async def test_a_router_whose_batches_never_fit_gets_the_engines_read_once_per_batch_and_second_at_most(
        tmp_path: Path) -> None:
    """Reading the engines at once for a held batch is what spares honest routers' batches a wait;
    a router sending batch after batch the engines never counted must not turn it into an engine
    reading per report: once per batch (sent again, it waits for the poll), and for one router
    at most once per second of the controller's clock (held still here)."""
    import aiohttp

    from tests.control.test_feed_replica_stats import Clock

    store = Store(tmp_path / "llmgw.db").open()
    clock = Clock()
    hub = FeedHub(keepalive=0.2, clock=clock)
    hub.set_catalog(CATALOG)
    reads: list[list[str]] = []

    async def read_engines(models: object) -> None:
        reads.append(sorted(models))  # type: ignore[call-overload]

    hub.ledger = GatedLedger(store, lambda: {"chat-g1": ("chat", 0.0, 0.0)}, models=lambda: {"chat"}, clock=clock)
    hub.read_engines = read_engines
    port = free_port()
    runner = await serve(make_app(hub, TOKEN), port)

    async def report(s: aiohttp.ClientSession, process: int) -> bool:
        """A batch as a new process of the router would send it; whether it waits."""
        row = {"minute": 60, "tenant": "search", "key": "web", "model": "chat", "requests": 1,
               "completion_tokens": 10 ** 6}
        batch = {"instance": f"forger/p{process}", "seq": 1, "rows": [row]}
        async with s.post(f"http://127.0.0.1:{port}{REPORT_PATH}", json={"router_id": "forger", "usage": batch}) as r:
            assert r.status == 200
            return (await r.json()).get("usage_waiting") == 1

    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
            assert await report(s, 1) and reads == [["chat"]]
            for _ in range(5):
                assert await report(s, 1)  # the same batch again: no reading
            assert len(reads) == 1
            clock.now += 0.5
            assert await report(s, 2)  # another batch (a new process) within the second: none
            assert len(reads) == 1
            clock.now += 0.6
            assert await report(s, 3) and len(reads) == 2
            assert await report(s, 3) and len(reads) == 2
    finally:
        await runner.cleanup()
    assert not totals(store).get("requests")
    store.close()


async def test_a_stopping_router_sends_its_last_batch_again_past_a_store_error_or_two(
        chat_sim: SimProcess, tmp_path: Path) -> None:
    """A store that fails once (a locked database on a busy machine) answers a report without
    taking its batch; a router stopping right then tries again a few times instead of losing it."""
    from llmgw.router.follow import FeedClient

    store = Store(tmp_path / "llmgw.db").open()

    class FailsTwice(StoreAway):
        def record_usage(self, batch: UsageBatch) -> None:
            if self.failed >= 2:
                self.back.set()
            super().record_usage(batch)

    flaky = FailsTwice(store)
    hub = FeedHub(keepalive=0.2)
    hub.ledger = flaky  # type: ignore[assignment]
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    router = Router(keys=KEYS, config=RouterConfig())
    port = free_port()
    runner = await serve(make_app(hub, TOKEN), port)
    sent = [0, 0]
    try:
        async with serving(router) as base, client(base, "sk-web") as c:
            # Reports an hour apart: the stop is what sends the usage.
            feed = FeedClient(router, f"http://127.0.0.1:{port}", TOKEN, router_id="r1", report_interval=3600)
            await feed.start()
            try:
                await until(lambda: router.table.has("chat"))
                for i in range(3):
                    p, n = await ask(c, stream=i % 2 == 0)
                    sent[0], sent[1] = sent[0] + p, sent[1] + n
            finally:
                await feed.close()
        got = totals(store)
        assert flaky.failed == 2
        assert (got["requests"], got["prompt_tokens"], got["completion_tokens"]) == (3, *sent)
    finally:
        await runner.cleanup()
        store.close()
