"""The usage ledger (issue 18): routers' usage reaches the controller's store exactly once, however
reports are lost, resent or cut off, with the real openai client, real simulated engines, a real
FeedHub over HTTP and a real SQLite store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
from aiohttp import web

from llmgw.catalog.model import Catalog, Limits, Settings, Tenant
from llmgw.contract import REPORT_PATH, UsageBatch, UsageRow
from llmgw.control.feed import FeedHub
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from llmgw.router.usage import Usage, UsageOutbox
from llmgw.state import Store
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
                             "counted_from_stream": 1}
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
            await until(lambda: router.usage_outbox.pending == 0 and len(dropped) == 3, timeout=10)
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
            await until(lambda: router.usage_outbox.pending == 0, timeout=10)
            # The last answers before a stop: sent by the feed's close, not lost with the process.
            for _ in range(3):
                p, n = await ask(c, stream=False)
                sent[0], sent[1] = sent[0] + p, sent[1] + n
        await runner.cleanup()
    got = totals(store)
    assert (got["requests"], got["prompt_tokens"], got["completion_tokens"]) == (9, *sent)
    store.close()
