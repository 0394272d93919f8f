"""The watch stream end to end in one process: a FeedHub served over HTTP, a Router following it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest
from aiohttp import web

from llmgw.catalog.model import Catalog
from llmgw.control.feed import FeedHub
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import FeedClient, Router, RouterConfig, hash_key
from tests.router.conftest import TOKEN, client, endpoint, serving
from tests.router.fake_controller import make_app, model

CATALOG = Catalog(models=(model("chat", aliases=("gpt-x",)), model("cold")))
HELLO = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def controller(hub: FeedHub, port: int) -> AsyncIterator[str]:
    runner = web.AppRunner(make_app(hub, TOKEN), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def following(router: Router, url: str, token: str = TOKEN) -> AsyncIterator[FeedClient]:
    feed = FeedClient(router, url, token, router_id="r1", report_interval=0.2, backoff_max=0.3)
    router.wake = feed.report_soon
    await feed.start()
    try:
        yield feed
    finally:
        await feed.close()


async def until(cond: Callable[[], object], timeout: float = 30.0) -> None:
    """Wait for ``cond`` (a bound on a hang, not a claim about the machine's speed)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


async def test_router_follows_the_hub_and_reports_back(chat_sim: SimProcess) -> None:
    woken: list[str] = []
    hub = FeedHub(wake=woken.append, keepalive=0.2)
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x"))])
    router = Router(config=RouterConfig(hold_timeout=60))  # the held request waits for the feed, not a timer
    port = free_port()
    async with controller(hub, port) as url, following(router, url) as feed, serving(router) as base:
        await until(lambda: router.table.has("chat"))
        assert hub.watchers == 1 and feed.connected
        async with client(base) as c:
            assert (await c.chat.completions.create(model="gpt-x", messages=HELLO)).choices
            await until(lambda: "chat-g1" in hub.last_used())
            # A request held for a model at zero is reported at once, and the hub wakes the reconciler.
            held = asyncio.create_task(c.chat.completions.create(model="cold", messages=HELLO))
            await until(lambda: woken == ["cold"])
            assert hub.demand()["cold"].held == 1
            hub.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x")),
                               endpoint("cold", chat_sim.endpoint)])
            assert (await asyncio.wait_for(held, 60)).choices
        # Keepalives flow while nothing changes; the snapshot count does not move.
        count = feed.snapshots
        await asyncio.sleep(0.5)
        assert feed.snapshots == count and feed.connected


async def test_router_keeps_serving_while_the_hub_is_away_and_follows_it_back(chat_sim: SimProcess) -> None:
    hub = FeedHub(keepalive=0.2)
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x"))])
    router = Router()
    port = free_port()
    async with following(router, f"http://127.0.0.1:{port}") as feed, serving(router) as base, client(base) as c:
        async with controller(hub, port):
            await until(lambda: router.table.has("chat"))
        await until(lambda: not feed.connected)
        for _ in range(5):
            assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
        # A restarted controller (a new hub) with one more replica: the router follows it.
        hub2 = FeedHub(keepalive=0.2)
        hub2.set_catalog(CATALOG)
        hub2.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x")),
                            endpoint("cold", chat_sim.endpoint)])
        async with controller(hub2, port):
            await until(lambda: router.table.has("cold"))
            assert (await c.chat.completions.create(model="cold", messages=HELLO)).choices


async def test_a_wrong_token_is_refused_and_nothing_is_served() -> None:
    hub = FeedHub()
    hub.set_catalog(CATALOG)
    hub.set_endpoints([])
    router = Router()
    port = free_port()
    async with controller(hub, port) as url, following(router, url, token="wrong") as feed, \
            serving(router) as base:
        await until(lambda: feed.attempts >= 2)  # refused once, and tried again
        assert not feed.connected and feed.snapshots == 0 and hub.watchers == 0
        async with aiohttp.ClientSession() as s, s.get(base + "/health") as resp:
            assert resp.status == 503  # no catalog yet: a load balancer keeps traffic away


async def test_routers_check_the_keys_the_controller_sends(chat_sim: SimProcess) -> None:
    hub = FeedHub(keepalive=0.2)
    hub.set_catalog(CATALOG)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x"))])
    router = Router()
    port = free_port()
    async with controller(hub, port) as url, following(router, url), serving(router) as base:
        await until(lambda: router.table.has("chat"))
        assert router.keys.open
        hub.set_api_keys([{"name": "team", "sha256": hash_key("sk-team"), "models": ["gpt-x"]}])
        await until(lambda: not router.keys.open)
        async with client(base, "sk-team") as c:
            assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
        async with client(base, "sk-other") as c:
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model="chat", messages=HELLO)
