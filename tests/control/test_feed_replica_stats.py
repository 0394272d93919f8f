"""What standalone routers measured of each replica reaches the controller (issue 26): carried by
their reports, kept with each router's report and forgotten with it, merged with the in-process
router's, and a malformed part refused clearly. A real FeedHub on a real port, real Routers, a
real simulated engine and the real openai client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from llmgw.catalog.model import Catalog
from llmgw.contract import REPORT_PATH, WATCH_PATH, PromptCache, ReplicaStats
from llmgw.control.feed import MAX_REPORTED_REPLICAS, FeedHub, MergedUsage
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import FeedClient, Router
from tests.router.conftest import TOKEN, client, endpoint, serving
from tests.router.fake_controller import make_app, model

HELLO = [{"role": "user", "content": "hi"}]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def hub_served(hub: FeedHub, app: web.Application | None = None) -> AsyncIterator[str]:
    """``hub`` on a real port, behind the admin token (or as ``app`` serves it)."""
    runner = web.AppRunner(app or make_app(hub, TOKEN), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def post(url: str, report: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url + REPORT_PATH, json=report, headers=AUTH,
                                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return resp.status, await resp.json()


def stats(requests: int, errors: int = 0, ttft: float = 0.05) -> ReplicaStats:
    s = ReplicaStats()
    for i in range(requests):
        s.observe(error=i < errors, ttft=None if i < errors else ttft)
    return s


def report(router_id: str, instance: Any, replicas: Any) -> dict[str, Any]:
    return {"router_id": router_id, "last_used": {}, "demand": {},
            "replica_stats": {"instance": instance, "replicas": replicas}}


async def until(cond: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


async def test_reports_carry_replica_stats_kept_per_router_and_forgotten_with_the_report() -> None:
    clock = Clock()
    hub = FeedHub(clock=clock, report_ttl=30.0)
    a, b = stats(10, errors=2), stats(4, ttft=0.4)
    async with hub_served(hub) as url:
        assert (await post(url, report("r1", "i1", {"stable": a.to_json(), "canary": b.to_json()})))[0] == 200
        assert (await post(url, report("r2", "i2", {"stable": stats(3).to_json()})))[0] == 200
        # A router that does not report them (an older one) is no error and adds nothing.
        assert (await post(url, {"router_id": "r3", "last_used": {}, "demand": {}}))[0] == 200
        assert hub.replica_stats() == {"i1": {"stable": a, "canary": b}, "i2": {"stable": stats(3)}}
        assert hub.replica_stats()["i1"]["stable"].error_rate == 0.2
        # A later report of the same router replaces its figures (they are cumulative).
        clock.now += 20
        assert (await post(url, report("r1", "i1", {"stable": stats(12, errors=2).to_json()})))[0] == 200
        assert hub.replica_stats()["i1"] == {"stable": stats(12, errors=2)}
        # r2 silent for longer than report_ttl: its figures go with its report; r1's stay.
        clock.now += 15
        assert set(hub.replica_stats()) == {"i1"}
        clock.now += 30
        assert hub.replica_stats() == {}


async def test_malformed_replica_stats_are_refused_clearly_and_nothing_of_the_report_is_kept() -> None:
    hub = FeedHub()
    good = stats(2).to_json()
    bad_cases: list[tuple[Any, str]] = [
        ("nope", "replica_stats must be an object"),
        ({"replicas": {"a": good}}, "replica_stats.instance"),
        ({"instance": 7, "replicas": {"a": good}}, "replica_stats.instance"),
        ({"instance": "i", "replicas": ["a"]}, "replica_stats.replicas must be an object"),
        ({"instance": "i", "replicas": {"a": {"requests": -1}}}, "replica_stats of 'a'"),
        ({"instance": "i", "replicas": {"a": {"requests": 1, "errors": 2}}}, "more errors and refusals than requests"),
        ({"instance": "i", "replicas": {"a": {"requests": 2, "errors": 1, "refused": 2}}}, "more errors and refusals"),
        ({"instance": "i", "replicas": {"a": {"requests": 1, "tpot": {"x": 1}}}}, "tpot bucket"),
        ({"instance": "i", "replicas": {"a": {"requests": 1, "ttft": {"999": 1}}}}, "ttft bucket"),
        ({"instance": "i", "replicas": {"a": {"requests": 1.5}}}, "requests must be a whole number"),
        ({"instance": "i", "replicas": {str(n): {} for n in range(MAX_REPORTED_REPLICAS + 1)}},
         f"at most {MAX_REPORTED_REPLICAS}"),
    ]
    async with hub_served(hub) as url:
        for part, words in bad_cases:
            status, body = await post(url, {"router_id": "r1", "last_used": {"x": 1.0}, "demand": {},
                                            "replica_stats": part})
            assert status == 400, part
            assert body["error"].startswith("malformed router report: "), body
            assert words in body["error"], (words, body)
        assert hub.replica_stats() == {} and hub.routers() == {}  # the same as a malformed prompt_cache


class OldSource:
    """A usage source from before replica stats (no ``replica_stats`` method)."""

    def last_used(self) -> dict[str, float]:
        return {}

    def demand(self) -> dict[str, Any]:
        return {}

    def prompt_cache(self) -> dict[str, PromptCache]:
        return {}


async def test_a_standalone_routers_measurements_reach_the_controller_merged_with_its_own() -> None:
    catalog = Catalog(models=(model("chat"),))
    with SimProcess("chat") as sim:
        eps = [endpoint("chat", sim.endpoint, "chat-g1")]
        hub = FeedHub(keepalive=0.2)
        hub.set_catalog(catalog)
        hub.set_endpoints(eps)
        standalone, local = Router(), Router()
        local.set_catalog(catalog)
        local.set_endpoints(eps)
        async with hub_served(hub) as url, serving(standalone) as base, serving(local) as local_base:
            feed = FeedClient(standalone, url, TOKEN, router_id="r1", report_interval=0.2, backoff_max=0.3)
            await feed.start()
            try:
                await until(lambda: standalone.table.has("chat"))
                async with client(base) as c:
                    for _ in range(3):
                        assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
                async with client(local_base) as c:
                    assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
                await until(lambda: hub.replica_stats().get(standalone.usage.instance_id, {}).get(
                    "chat-g1", ReplicaStats()).requests == 3)
            finally:
                await feed.close()
        merged = MergedUsage(local.usage, hub, OldSource()).replica_stats()
        assert set(merged) == {local.usage.instance_id, standalone.usage.instance_id}
        assert merged[standalone.usage.instance_id] == standalone.usage.replica_stats()[standalone.usage.instance_id]
        assert merged[local.usage.instance_id]["chat-g1"].requests == 1
        # Histograms survive the wire: whole answers, each its time per output token.
        assert sum(merged[standalone.usage.instance_id]["chat-g1"].tpot) == 3


async def test_reports_are_bounded_in_routers_and_entries_and_what_is_refused_is_counted() -> None:
    """Issue 39: made-up router ids shrank every router's share of limits while Redis was away and
    evicted real routers' canary baselines; last_used and demand were unbounded."""
    from llmgw.control.feed import MAX_ROUTERS

    hub = FeedHub(clock=Clock())
    async with hub_served(hub) as url:
        for i in range(MAX_ROUTERS):
            assert (await post(url, {"router_id": f"r{i}"}))[0] == 200
        status, answer = await post(url, {"router_id": "one-too-many"})
        assert status == 429 and f"at most {MAX_ROUTERS}" in answer["error"]
        assert hub.refused_routers == 1 and len(hub.routers()) == MAX_ROUTERS and "one-too-many" not in hub.routers()
        assert (await post(url, {"router_id": "r0"}))[0] == 200  # one already counted goes on reporting
        big = {f"x{i}": 1.0 for i in range(MAX_REPORTED_REPLICAS + 1)}
        status, answer = await post(url, {"router_id": "r1", "last_used": big})
        assert status == 400 and "last_used" in answer["error"]
        status, answer = await post(url, {"router_id": "r1", "demand": {k: {"held": 1} for k in big}})
        assert status == 400 and "demand" in answer["error"]
    # What was dropped is counted where an operator looks: the controller's metrics.
    from prometheus_client import CollectorRegistry, generate_latest

    from llmgw.control.feed import ReportsCollector

    registry = CollectorRegistry()
    registry.register(ReportsCollector(hub, lambda: 7))
    text = generate_latest(registry).decode()
    assert 'llmgw_controller_router_reports_refused_total{reason="too_many_routers"} 1.0' in text
    assert 'llmgw_controller_router_reports_refused_total{reason="malformed"} 2.0' in text
    assert "llmgw_controller_router_readings_forgotten_total 7.0" in text


@asynccontextmanager
async def hub_served_to_routers(hub: FeedHub, credentials: dict[str, str]) -> AsyncIterator[str]:
    """The hub behind router credentials (``{credential: router name}``), as the admin listener
    puts them: the request carries the router the credential names (llmgw.control.router_credentials)."""
    from llmgw.access.roles import Principal
    from llmgw.access.web import PRINCIPAL

    @web.middleware
    async def who(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        name = credentials.get(request.headers.get("Authorization", "").removeprefix("Bearer "))
        if name is None:
            return web.json_response({"error": "not a router credential"}, status=401)
        request[PRINCIPAL] = Principal(f"router:{name}", None, via="router", router=name, credential=f"sha-{name}")
        return await handler(request)

    app = web.Application(middlewares=[who])
    app.router.add_post(REPORT_PATH, hub.report)
    app.router.add_get(WATCH_PATH, hub.watch)
    async with hub_served(hub, app) as url:
        yield url


async def test_a_routers_measurements_are_filed_under_its_credential_whatever_process_it_names() -> None:
    """Issue 41: a canary is judged on each router's figures alone too, and a rollback names the
    router whose figures failed it; a router holding credential A that names router B's process
    must not write into B's figures nor be named as B."""
    hub = FeedHub()
    async with hub_served_to_routers(hub, {"cred-a": "edge-a", "cred-b": "edge-b"}) as url:
        async def send(credential: str, body: dict[str, Any]) -> int:
            async with aiohttp.ClientSession() as s, s.post(
                    url + REPORT_PATH, json=body, headers={"Authorization": f"Bearer {credential}"},
                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return resp.status

        assert await send("cred-b", report("edge-b", "9d1e", {"canary": stats(5, errors=1).to_json()})) == 200
        # edge-a claims to be edge-b, and edge-b's process, with a thousand good canary requests.
        assert await send("cred-a", report("edge-b", "edge-b/9d1e", {"canary": stats(1000).to_json()})) == 200
    assert hub.replica_stats() == {"edge-b/9d1e": {"canary": stats(5, errors=1)},
                                   "edge-a/edge-b/9d1e": {"canary": stats(1000)}}
    assert set(hub.routers()) == {"edge-a", "edge-b"}
