"""What the controller waits for before it stops a withdrawn replica's engine (the drain): requests
the routers have in flight on it, and routers not yet serving without it. A real FeedHub on a real
port, real Routers following it, a real simulated engine streaming, the real openai client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from llmgw.catalog.model import Catalog
from llmgw.contract import REPORT_PATH, WATCH_PATH
from llmgw.control.feed import BEHIND_GRACE, MAX_REPORTED_REPLICAS, FeedHub, MergedUsage
from llmgw.engines.testing import SimProcess
from llmgw.router import FeedClient, Router
from tests.control.test_feed_replica_stats import HELLO, Clock, hub_served, hub_served_to_routers, post, until
from tests.router.conftest import TOKEN, client, endpoint, serving
from tests.router.fake_controller import model


def report(router_id: str, **extra: Any) -> dict[str, Any]:
    return {"router_id": router_id, "last_used": {}, "demand": {}, "report_interval": 2.0, **extra}


async def test_a_withdrawn_replica_counts_for_each_router_still_serving_an_older_list() -> None:
    hub = FeedHub(clock=Clock(), report_ttl=30)
    hub.set_catalog(Catalog(models=(model("chat"),)))
    hub.set_endpoints([endpoint("chat", "http://127.0.0.1:1", "a"), endpoint("chat", "http://127.0.0.1:2", "b")])
    before = hub.version
    async with hub_served(hub) as url:
        for rid in ("r1", "r2"):
            assert (await post(url, report(rid, in_flight={"a": 1}, applied_version=before)))[0] == 200
        assert hub.in_flight_by_replica() == {"a": 2}
        hub.set_endpoints([endpoint("chat", "http://127.0.0.1:2", "b")])  # "a" withdrawn
        # Both routers still on the list with "a" in it: each may send it one more.
        assert hub.in_flight_by_replica() == {"a": 4}
        assert (await post(url, report("r1", in_flight={"a": 1}, applied_version=hub.version)))[0] == 200
        assert hub.in_flight_by_replica() == {"a": 3}
        assert (await post(url, report("r2", in_flight={}, applied_version=hub.version)))[0] == 200
        assert (await post(url, report("r1", in_flight={}, applied_version=hub.version)))[0] == 200
        assert hub.in_flight_by_replica() == {}
        # A router from before drains (no version in its report) holds nothing up.
        hub.set_endpoints([])
        old = report("r3")
        del old["report_interval"]
        assert (await post(url, old))[0] == 200
        assert hub.in_flight_by_replica() == {"b": 2}  # r1 and r2 behind; r3 says nothing
        # r2 stops in order (its last report says so): it holds nothing up from then on.
        assert (await post(url, report("r2", leaving=True)))[0] == 200
        assert hub.in_flight_by_replica() == {"b": 1}
        # r1 killed without a word: behind only while its silence is short (3 of its intervals).
        hub.clock.now += 3 * 2.0 + 2  # type: ignore[attr-defined]
        assert hub.in_flight_by_replica() == {} and "r1" in hub.routers()  # still heard of (report_ttl), not waited on


async def test_a_router_that_says_it_is_behind_long_after_it_was_sent_the_list_holds_no_drain() -> None:
    """Issue 41: a router credential's report alone held a scale-down stop for the whole drain
    timeout by saying it still served an older list. Once the controller has written the new list
    to that router's own watch stream, it is believed behind for BEHIND_GRACE seconds, no longer;
    what it says is shown. A router never sent the list (no watch of its own) is still believed."""
    clock = Clock()
    hub = FeedHub(clock=clock, report_ttl=300, keepalive=0.2)
    hub.set_catalog(Catalog(models=(model("chat"),)))
    hub.set_endpoints([endpoint("chat", "http://127.0.0.1:1", "a"), endpoint("chat", "http://127.0.0.1:2", "b")])
    before = hub.version
    async with hub_served_to_routers(hub, {"cred-1": "edge-1", "cred-2": "edge-2"}) as url, \
            aiohttp.ClientSession() as s:
        async def send(credential: str, applied: int) -> None:
            body = report("ignored", in_flight={}, applied_version=applied)
            async with s.post(url + REPORT_PATH, json=body, headers={"Authorization": f"Bearer {credential}"},
                              timeout=aiohttp.ClientTimeout(total=10)) as resp:
                assert resp.status == 200, await resp.text()

        async with s.get(url + WATCH_PATH, headers={"Authorization": "Bearer cred-1"},
                         timeout=aiohttp.ClientTimeout(total=30)) as watch:
            assert json.loads(await watch.content.readline())["version"] == before
            await send("cred-1", before)
            await send("cred-2", before)
            hub.set_endpoints([endpoint("chat", "http://127.0.0.1:2", "b")])  # "a" withdrawn
            while json.loads(line := await watch.content.readline() or b"{}").get("version") != hub.version:
                assert line, "the watch ended"
            await send("cred-1", before)  # edge-1 got the new list, and says it serves the old one
            await send("cred-2", before)  # edge-2 has no watch: it may really be behind
            assert hub.in_flight_by_replica() == {"a": 2}  # within the grace, both believed
            clock.now += BEHIND_GRACE + 1
            await send("cred-1", before)
            await send("cred-2", before)
            assert hub.in_flight_by_replica() == {"a": 1}  # edge-2 only
            shown = hub.router_reports()
            assert shown["edge-1"]["behind_unbelieved"] is True and shown["edge-2"]["behind_unbelieved"] is False


async def test_malformed_in_flight_or_version_is_refused_clearly_and_nothing_is_kept() -> None:
    hub = FeedHub()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"in_flight": ["a"]}, "in_flight must be an object"),
        ({"in_flight": {"a": -1}}, "in_flight of 'a' must be a whole number"),
        ({"in_flight": {"a": 1.5}}, "in_flight of 'a' must be a whole number"),
        ({"in_flight": {"a": True}}, "in_flight of 'a' must be a whole number"),
        ({"in_flight": {str(n): 1 for n in range(MAX_REPORTED_REPLICAS + 1)}}, f"at most {MAX_REPORTED_REPLICAS}"),
        ({"applied_version": "7"}, "applied_version must be a whole number"),
        ({"report_interval": 0}, "report_interval must be seconds from 0 to 3600"),
        ({"report_interval": True}, "report_interval must be seconds from 0 to 3600"),
        ({"report_interval": 1e9}, "report_interval must be seconds from 0 to 3600"),
    ]
    async with hub_served(hub) as url:
        for extra, words in cases:
            status, body = await post(url, report("r1", **extra))
            assert status == 400 and body["error"].startswith("malformed router report: "), body
            assert words in body["error"], (words, body)
    assert hub.routers() == {} and hub.in_flight_by_replica() == {}


async def test_a_standalone_routers_stream_on_a_withdrawn_replica_is_in_flight_until_it_ends() -> None:
    catalog = Catalog(models=(model("chat"),))
    # The engine holds each stream's first token until two generations run: the router's stream
    # stays in flight, withdrawn, for as long as the test takes to see it so (a pace of tokens
    # would have to outlast the reports and the feed on whatever machine), then a second request
    # straight to the engine lets it go on to its end.
    with SimProcess("chat", "--tokens-per-second", "20", "--hold-until-running", "2", "--hold-timeout", "60") as sim:
        eps = [endpoint("chat", sim.endpoint, "chat-g1")]
        hub = FeedHub(keepalive=0.2)
        hub.set_catalog(catalog)
        hub.set_endpoints(eps)
        standalone, local = Router(), Router()
        local.set_catalog(catalog)
        local.set_endpoints(eps)
        merged = MergedUsage(local.usage, hub)
        async with hub_served(hub) as url, serving(standalone) as base:
            feed = FeedClient(standalone, url, TOKEN, router_id="r1", report_interval=0.2, backoff_max=0.3)
            await feed.start()
            try:
                await until(lambda: standalone.table.has("chat"))
                async with client(base) as c, client(sim.endpoint) as direct:
                    started = asyncio.create_task(c.chat.completions.create(
                        model="chat", messages=HELLO, max_tokens=40, stream=True))
                    await until(lambda: merged.in_flight_by_replica() == {"chat-g1": 1})
                    hub.set_endpoints([])  # withdrawn, as the reconciler does before it stops anything
                    local.set_endpoints([])
                    await until(lambda: not standalone.table.has("chat"))
                    # Serving without it, and its stream (held) still counted in flight.
                    await until(lambda: merged.in_flight_by_replica() == {"chat-g1": 1})
                    assert not started.done()
                    release = asyncio.create_task(direct.chat.completions.create(
                        model="chat", messages=HELLO, max_tokens=1))
                    stream = await started
                    chunks = [chunk async for chunk in stream]
                    assert (await release).choices
                    assert chunks[-1].choices[0].finish_reason == "length"  # the withdrawal cut nothing
                    assert merged.in_flight_by_replica() in ({"chat-g1": 1}, {})  # the last report may predate the end
                    await until(lambda: merged.in_flight_by_replica() == {})
            finally:
                await feed.close()
