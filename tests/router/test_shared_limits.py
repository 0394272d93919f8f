"""Tenants' limits shared by two routers through one real ``redis-server``, and what a router
does when Redis goes away (degraded mode: it limits on its own, says so, and does not fail)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack

import aiohttp
import openai
import pytest

from llmgw.catalog.model import Budget, Catalog, Limits, Settings, Tenant
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from llmgw.router.shared_limits import redacted
from tests.router.conftest import endpoint, serving, sim_metric
from tests.router.fake_controller import model

pytestmark = pytest.mark.skipif(not shutil.which("redis-server"),
                                reason="redis-server is not installed (apt-get install redis-server)")
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def redis_url() -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--daemonize", "no"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    import socket

    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait(5)


def router(chat_sim: SimProcess, url: str, limits: Limits) -> Router:
    keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
    r = Router(keys=keys, config=RouterConfig(limits_redis=url))
    r.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(Tenant("team", ("team-key",), limits),))))
    r.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    return r


async def metric(base: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
        text = await resp.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_two_routers_enforce_one_tenants_limit_together(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001
    url, _ = redis_url
    before = sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total")
    async with AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(router(chat_sim, url, Limits(requests_per_minute=10))))
                 for _ in range(2)]
        clients = [openai.AsyncOpenAI(base_url=b + "/v1", api_key="sk-team", max_retries=0, timeout=15) for b in bases]
        ok = refused = 0
        for i in range(16):  # alternating: each router alone would admit 10
            try:
                await clients[i % 2].chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
                ok += 1
            except openai.RateLimitError as exc:
                refused += 1
                assert exc.response.headers["x-ratelimit-limit-requests"] == "10"
        for c in clients:
            await c.close()
        assert await metric(bases[0], "llmgw_router_limits_degraded") == 0
    assert (ok, refused) == (10, 6)
    assert sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total") - before == 10


async def test_a_budget_spent_through_one_router_is_spent_for_the_other(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001
    url, _ = redis_url
    limits = Limits(budget=Budget(tokens=200, per="day"))
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serving(router(chat_sim, url, limits)))
        b = await stack.enter_async_context(serving(router(chat_sim, url, limits)))
        ca = openai.AsyncOpenAI(base_url=a + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        cb = openai.AsyncOpenAI(base_url=b + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        used = 0
        with pytest.raises(openai.RateLimitError) as refused:
            for _ in range(20):
                r = await ca.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=20)
                used += r.usage.total_tokens
        assert used <= 200
        with pytest.raises(openai.RateLimitError) as also:  # the other router sees the same budget
            await cb.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=20)
        assert "budget per day" in refused.value.message and "budget per day" in also.value.message
        await ca.close()
        await cb.close()


async def test_redis_going_away_degrades_to_local_limits_and_says_so(chat_sim: SimProcess, redis_url,  # noqa: ANN001
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    url, proc = redis_url
    async with serving(router(chat_sim, url, Limits(requests_per_minute=3))) as base:
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        proc.kill()
        proc.wait(5)
        # Still limited (locally, 3 a minute), never a 500, and the router says it is degraded.
        answers = []
        for _ in range(5):
            try:
                await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
                answers.append(200)
            except openai.RateLimitError:
                answers.append(429)
        assert answers == [200, 200, 200, 429, 429]
        assert await metric(base, "llmgw_router_limits_degraded") == 1
        await c.close()
    assert "cannot be reached" in caplog.text and "degraded mode" in caplog.text


def test_the_redis_password_never_reaches_a_log() -> None:
    assert redacted("redis://:s3cret@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert redacted("redis://user:s3cret@cache/1") == "redis://user:***@cache/1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_a_standalone_router_takes_the_redis_the_controller_names(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001
    import json

    from llmgw.contract import catalog_view
    from llmgw.control.feed import FeedHub
    from llmgw.router.follow import FeedClient

    url, _ = redis_url
    hub = FeedHub()
    catalog = Catalog(models=(model("chat"),), settings=Settings(tenants=(
        Tenant("team", ("team-key",), Limits(requests_per_minute=2)),)))
    hub.set_catalog(catalog)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    hub.set_limits_redis(url)
    snap = hub.snapshot()
    assert snap is not None and snap["limits_redis"] == url and snap["catalog"] == catalog_view(catalog)
    keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
    standalone = [Router(keys=keys) for _ in range(2)]
    for r in standalone:
        FeedClient(r, "http://controller.invalid", "token")._apply(json.dumps(snap).encode())
    async with AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(r)) for r in standalone]
        answers = []
        for i in range(4):
            async with openai.AsyncOpenAI(base_url=bases[i % 2] + "/v1", api_key="sk-team", max_retries=0,
                                          timeout=15) as c:
                try:
                    await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
                    answers.append(200)
                except openai.RateLimitError:
                    answers.append(429)
    assert answers == [200, 200, 429, 429]  # 2 a minute over both routers together
