"""What the router does differently per engine (llmgw.router.engines), through the real Router.

llama.cpp reports its exact counts in every answer's last ``timings`` unasked, and asked for a
stream's usage event it moves them there, where a client that did not ask would lose them: so a
stream to llama.cpp is asked for its timings in every event instead (``timings_per_token``, its
running count), and its usage and prompt-cache hits are read from them. Every other engine is
asked for the usage event and a running count in each event (``continuous_usage_stats``). Either
way, what the client did not ask for is taken out again before it sees it. The engine here is a
real HTTP server that answers as each engine does and records what it was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
from aiohttp import web

from llmgw.catalog.model import Catalog
from llmgw.contract import PromptCache
from llmgw.router import Router
from llmgw.router.engines import engine_profile
from llmgw.router.table import Upstream
from tests.router.conftest import client, endpoint, ledger_usage, serving, serving_app
from tests.router.fake_controller import model

HELLO = [{"role": "user", "content": "Hello"}]


def _event(d: dict) -> bytes:
    return b"data: " + json.dumps(d).encode() + b"\n\n"


def _chunk(content: str, finish: str | None = None, **extra: object) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}], **extra}


@asynccontextmanager
async def recording_engine(sent: list[dict]) -> AsyncIterator[str]:
    """Streams "Hello" in two events. Asked as vLLM is: a running count in each (with
    continuous_usage_stats) and a usage event (7 prompt, 2 completion tokens). Otherwise as
    llama.cpp does: its timings (5 prompt tokens, 3 of them from its cache, 2 predicted) in the
    last event, and in every event when asked (timings_per_token)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sent.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            def running(n: int) -> dict:
                return {"usage": {"prompt_tokens": 7, "total_tokens": 7 + n, "completion_tokens": n}} \
                    if options.get("continuous_usage_stats") else {}
            await resp.write(_event(_chunk("Hel", **running(1))))
            await resp.write(_event(_chunk("lo", "stop", **running(2))))
            await resp.write(_event({"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                     "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                                              "total_tokens": 9}}))
        else:
            def timings(n: int) -> dict:
                return {"timings": {"cache_n": 3, "prompt_n": 2, "predicted_n": n}}
            await resp.write(_event(_chunk("Hel", **(timings(1) if body.get("timings_per_token") else {}))))
            await resp.write(_event(_chunk("lo", "stop", **timings(2))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving_app(app) as url:
        yield url


@pytest.mark.parametrize(("engine", "reuse", "timings"), [
    ("llama.cpp", False, True), ("vllm", True, False), ("sglang", True, False), ("sim", True, False)])
def test_a_replica_takes_its_engines_profile_when_it_joins_the_table(engine: str, reuse: bool, timings: bool) -> None:
    up = Upstream(replace(endpoint("m", "http://127.0.0.1:1"), engine=engine))
    assert up.engine == engine_profile(engine)
    # llama-server drops idle keep-alive connections while busy: a request sent on one is lost.
    assert up.origin.reuse is reuse
    assert up.engine.timings is timings


async def test_each_engine_is_asked_for_its_running_counts_its_own_way_and_the_client_sees_none() -> None:
    sent: list[dict] = []
    async with recording_engine(sent) as url:
        router = Router()
        router.set_catalog(Catalog(models=(model("l"), model("v"))))
        router.set_endpoints([replace(endpoint("l", url, "l-1"), engine="llama.cpp"),
                              replace(endpoint("v", url, "v-1"), engine="vllm")])
        async with serving(router) as base, client(base) as cl:
            seen = {}
            for name in ("l", "v"):
                stream = await cl.chat.completions.create(model=name, messages=HELLO, stream=True, max_tokens=4)
                chunks = [c async for c in stream]
                seen[name] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                              [c.usage for c in chunks if c.usage is not None],
                              ["timings" in (c.model_extra or {}) for c in chunks])
    assert [("stream_options" in b, "timings_per_token" in b) for b in sent] == [(False, True), (True, False)]
    assert sent[1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    # The client asked for no usage, and got none, from either engine; llama.cpp's last event has
    # its timings, as it writes them unasked, and only that one; the answer is whole.
    assert seen == {"l": ("Hello", [], [False, True]), "v": ("Hello", [], [False, False])}
    usage = ledger_usage(router)
    assert (usage[("", "l")].prompt_tokens, usage[("", "l")].completion_tokens) == (5, 2)
    assert (usage[("", "v")].prompt_tokens, usage[("", "v")].completion_tokens) == (7, 2)
    assert usage[("", "l")].counted_from_stream == usage[("", "v")].counted_from_stream == 0
    # Prompt-cache hits from llama.cpp's timings; an engine without them adds none per answer.
    cache = router.usage.prompt_cache()
    assert cache["l"] == PromptCache(prompt_tokens=5, cached_tokens=3)
    assert "v" not in cache


async def test_a_reading_that_cannot_be_applied_is_counted_each_time_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A replica whose readings keep failing is a metric per poll and one log line, until it
    reads well again (it was a traceback per replica per second)."""
    import aiohttp

    from llmgw.contract import Endpoint
    from llmgw.router.load import LoadReader
    from llmgw.router.table import EndpointTable

    served = [0]

    async def metrics(_request: web.Request) -> web.Response:
        served[0] += 1
        return web.Response(text=f"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
                                 f"vllm:prefix_cache_queries_total {served[0] * 10}\n"
                                 f"vllm:prefix_cache_hits_total {served[0] * 5}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    up = Upstream(Endpoint("r1", "m", ("m",), f"http://127.0.0.1:{port}", "vllm", "p", 0))
    table = EndpointTable({}, {"r1": up}, version=1)
    broken, odd = [True], []

    def prefix_counts(_u: Upstream, _queries: float, _hits: float) -> None:
        if broken[0]:
            raise RuntimeError("a bug in what a reading feeds")

    caplog.set_level("ERROR", logger="llmgw.router.load")
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(LoadReader(lambda: table, session, prefix_counts, odd=odd.append).run(0.01))
        try:
            while len(odd) < 5:
                await asyncio.sleep(0.01)
            assert [r.message for r in caplog.records].count(
                f"ignoring the load read from {up.url} (said once until it reads well again)") == 1
            broken[0] = False
            seen = served[0]
            while served[0] < seen + 3:  # good readings again
                await asyncio.sleep(0.01)
            broken[0] = True
            while len([r for r in caplog.records if "ignoring the load" in r.message]) < 2:
                await asyncio.sleep(0.01)  # failing anew is said anew
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await runner.cleanup()
    assert all(u is up for u in odd) and up.engine_load == (1, 0)


@asynccontextmanager
async def metrics_engines(answer: Callable[[str], Awaitable[str]], names: tuple[str, ...]
                          ) -> AsyncIterator[dict[str, Upstream]]:
    """One real HTTP engine per name whose ``/metrics`` is ``answer(name)``, and an Upstream of
    model ``name`` for each (the table's replicas)."""
    from llmgw.contract import Endpoint

    def engine(name: str) -> web.Application:
        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(text=await answer(name))
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app

    runners, ups = [], {}
    try:
        for name in names:
            runner = web.AppRunner(engine(name))
            runners.append(runner)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            ups[name] = Upstream(Endpoint(f"{name}-r1", name, (name,), f"http://127.0.0.1:{runner.addresses[0][1]}",
                                          "sim", "p", 0))
        yield ups
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_an_engine_read_at_once_is_read_for_its_model_alone_and_not_more_than_once_a_second() -> None:
    """The usage gate asks for a fresh reading of a model's engines before it holds a router's batch:
    only that model's replicas are read, and a router whose batches never fit cannot make the
    controller read an engine on every report (READ_NOW_EVERY apart at most)."""
    import aiohttp

    from llmgw.router.load import READ_NOW_EVERY, LoadReader
    from llmgw.router.table import EndpointTable

    served: list[str] = []

    async def answer(name: str) -> str:
        served.append(name)
        return (f"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                f"vllm:generation_tokens_total {10 * served.count(name)}\n")

    async with metrics_engines(answer, ("a", "b")) as ups, aiohttp.ClientSession() as session:
        table = EndpointTable({}, {u.replica_id: u for u in ups.values()}, version=1)
        reader = LoadReader(lambda: table, session)
        await reader.read_now({"a"})
        assert served == ["a"] and ups["a"].engine_tokens is not None and ups["b"].engine_tokens is None
        for _ in range(20):
            await reader.read_now({"a"})
        assert served == ["a"]  # asked again at once: the reading just made stands
        await asyncio.sleep(READ_NOW_EVERY)
        await reader.read_now({"a", "b"})
        assert sorted(served) == ["a", "a", "b"]


async def test_a_reading_that_answers_after_a_later_one_is_not_applied_over_it() -> None:
    """The poll reads every replica together and applies their answers when the slowest has come;
    a read at once of one model meanwhile is newer. Applied after it, the poll's older counter
    would go backwards, which reads as an engine restarted: the usage gate counted the engine's
    whole past again (a review found an allowance doubled this way)."""
    import aiohttp

    from llmgw.router.load import LoadReader
    from llmgw.router.table import EndpointTable

    served = {"fast": 0, "slow": 0}
    slow_gate = asyncio.Event()

    async def answer(name: str) -> str:
        served[name] += 1
        count = served[name]
        if name == "slow":
            await slow_gate.wait()
        return (f"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                f"vllm:generation_tokens_total {1000 * count}\n")

    async with metrics_engines(answer, ("fast", "slow")) as ups, aiohttp.ClientSession() as session:
        table = EndpointTable({}, {u.replica_id: u for u in ups.values()}, version=1)
        reader = LoadReader(lambda: table, session)
        poll = asyncio.create_task(reader.read(list(ups.values())))  # fast answers 1000, slow hangs
        while served["fast"] < 1 or served["slow"] < 1:
            await asyncio.sleep(0.01)
        await reader.read_now({"fast"})  # 2000, applied at once
        assert ups["fast"].engine_tokens == (None, 2000.0)
        slow_gate.set()
        await poll
        assert ups["fast"].engine_tokens == (None, 2000.0)  # the poll's 1000 came later: not applied
        assert ups["slow"].engine_tokens == (None, 1000.0)
