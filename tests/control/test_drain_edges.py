"""The drain's edges, found by review: a router that stopped holds nothing up, an engine whose
/metrics cannot be read shows no queue, a replica withdrawn twice counts the streams of both, a
restarted controller hears at once what a router has in flight.

Real parts: a real FeedHub on a real port, real Routers following it, the real simulated engine, a
scripted engine's /metrics over real HTTP, the real openai client.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from llmgw.catalog.model import Catalog
from llmgw.control.feed import FeedHub
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import FeedClient, Router
from llmgw.router.config import RouterConfig
from tests.control.test_feed_replica_stats import HELLO, hub_served, until
from tests.router.conftest import TOKEN, client, endpoint, serving, serving_app
from tests.router.fake_controller import make_app, model


async def test_a_router_that_stopped_does_not_hold_up_the_next_withdrawal() -> None:
    """A standalone router shut down (or restarted: it comes back under a new router id) leaves
    its last report, applied_version included, for report_ttl (30 s). Every replica withdrawn in
    that window is counted as "a router may still send it one": its engine is kept the whole
    drain_timeout and the event says "1 request(s) still in flight" when there is none."""
    catalog = Catalog(models=(model("chat"),))
    a, b, c = (endpoint("chat", f"http://127.0.0.1:{p}", rid) for p, rid in ((1, "a"), (2, "b"), (3, "c")))
    hub = FeedHub(keepalive=0.2)
    hub.set_catalog(catalog)
    hub.set_endpoints([a, b, c])
    async with hub_served(hub) as url:
        standalone = Router()
        async with serving(standalone):
            feed = FeedClient(standalone, url, TOKEN, router_id="r1", report_interval=0.1, backoff_max=0.3)
            await feed.start()
            try:
                await until(lambda: standalone.table.has("chat"))
                hub.set_endpoints([a, b])  # "c" withdrawn: wait until the router says it serves without it
                await until(lambda: "r1" in hub.routers() and hub.in_flight_by_replica() == {})
            finally:
                await feed.close()  # the router's orderly stop (its FeedClient first, as router.main does)
        # The router process is gone: nothing can send "a" a request any more.
        hub.set_endpoints([b])
        assert hub.in_flight_by_replica() == {}, (
            "a stopped router still counts as one that may send the withdrawn replica")


class ScriptedMetrics:
    """An engine's /metrics (vLLM's names): a reading, then 500s (a hung or dying engine)."""

    def __init__(self) -> None:
        self.failing = False
        self.asked_while_failing = 0

    async def metrics(self, _request: web.Request) -> web.Response:
        if self.failing:
            self.asked_while_failing += 1
            return web.Response(status=500, text="engine error")
        return web.Response(text="vllm:num_requests_running{model_name=\"chat\"} 2.0\n"
                                 "vllm:num_requests_waiting{model_name=\"chat\"} 5.0\n")


async def test_an_engine_whose_metrics_cannot_be_read_has_no_queue_figure() -> None:
    """UsageSource.engine_queue's contract (llmgw/contract.py, this commit): "replicas whose engine
    says nothing are absent (... an unreadable endpoint)". The Router keeps the last reading for
    routing (llmgw/router/load.py), and engine_queue() hands that on: `llmgw models`, the admin
    API and the dashboard go on showing "2 running, 5 waiting" for an engine that no longer
    answers, as if it were current."""
    engine = ScriptedMetrics()
    app = web.Application()
    app.router.add_get("/metrics", engine.metrics)
    async with serving_app(app) as url:
        router = Router(config=RouterConfig(load_interval=0.05))
        router.set_catalog(Catalog(models=(model("chat"),)))
        router.set_endpoints([endpoint("chat", url, "chat-g1")])
        async with serving(router):
            await until(lambda: router.usage.engine_queue() == {"chat-g1": (2, 5)})
            engine.failing = True
            # Two reads refused: the first one's outcome has been applied (reads are one round at a time).
            await until(lambda: engine.asked_while_failing >= 2)
            assert "chat-g1" not in router.usage.engine_queue(), router.usage.engine_queue()


async def test_a_replica_withdrawn_twice_counts_the_streams_of_both_times() -> None:
    """RouterUsage._leaving is keyed by replica id: a replica withdrawn with a stream on it, listed
    again (same id: an adopted replica after a controller restart is withdrawn until probed, a
    replica failed and restarted), given another stream, and withdrawn again loses the first
    upstream's count. The controller then stops the engine under the first stream."""
    catalog = Catalog(models=(model("chat"),))
    with SimProcess("chat", "--tokens-per-second", "10") as sim:
        ep = endpoint("chat", sim.endpoint, "chat-g1")
        router = Router()
        router.set_catalog(catalog)
        router.set_endpoints([ep])
        async with serving(router) as base, client(base) as c:
            first = await c.chat.completions.create(model="chat", messages=HELLO, max_tokens=200, stream=True)
            await anext(aiter(first))
            router.set_endpoints([])  # withdrawn (the first stream goes on)
            router.set_endpoints([ep])  # listed again, same id
            second = await c.chat.completions.create(model="chat", messages=HELLO, max_tokens=200, stream=True)
            await anext(aiter(second))
            router.set_endpoints([])  # withdrawn again: the drain starts
            try:
                assert router.usage.in_flight_by_replica() == {"chat-g1": 2}, router.usage.in_flight_by_replica()
            finally:
                await asyncio.gather(first.close(), second.close())


async def test_a_restarted_controller_hears_what_a_router_has_in_flight_without_waiting_an_interval() -> None:
    """The controller restarted mid-drain must learn the streams a standalone router still has on
    the replica before it stops it: the router reports as soon as it is following again, not at
    its next interval (30 s here)."""
    catalog = Catalog(models=(model("chat"),))
    with SimProcess("chat", "--tokens-per-second", "10") as sim:
        eps = [endpoint("chat", sim.endpoint, "chat-g1")]
        port = free_port()

        async def controller(hub: FeedHub) -> web.AppRunner:
            hub.set_catalog(catalog)
            hub.set_endpoints(eps)
            runner = web.AppRunner(make_app(hub, TOKEN), access_log=None, shutdown_timeout=0.1)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return runner

        first = await controller(FeedHub(keepalive=0.2))
        router = Router()
        feed = FeedClient(router, f"http://127.0.0.1:{port}", TOKEN, router_id="r1", report_interval=30,
                          backoff_max=0.3)
        await feed.start()
        try:
            async with serving(router) as base, client(base) as c:
                await until(lambda: router.table.has("chat"))
                stream = await c.chat.completions.create(model="chat", messages=HELLO, max_tokens=200, stream=True)
                await anext(aiter(stream))
                await first.cleanup()  # the controller goes away...
                second = FeedHub(keepalive=0.2)
                runner = await controller(second)  # ...and comes back, knowing nothing
                try:
                    await until(lambda: second.in_flight_by_replica() == {"chat-g1": 1}, timeout=10)
                finally:
                    await stream.close()
                    await runner.cleanup()
        finally:
            await feed.close()
