"""Routers as their own processes: load through one, two following a controller that dies and returns."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from llmgw.engines.sim import VOCAB, _chat_seed, prompt_words
from llmgw.engines.testing import SimProcess
from tests.router.conftest import Proc, endpoint, fake_controller, get_json, router_process, write_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ~20 s each on a busy box: the default 60 s is near

TOKENS = 8


def expected_text(body: dict) -> str:
    seed, _ = _chat_seed(body)
    return " ".join(VOCAB[w] for w in prompt_words(seed, TOKENS))


async def one_stream(session: aiohttp.ClientSession, base: str, i: int) -> str | None:
    """One streamed chat; None when it arrived complete and exactly as the engine generates it."""
    body = {"model": "load", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": TOKENS,
            "stream": True}
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return f"{i}: status {resp.status} {await resp.text()}"
        raw = await resp.read()
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    if events[-1] != "[DONE]":
        return f"{i}: stream did not end with [DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in map(json.loads, events[:-1])
                   if c["choices"])
    return None if text == expected_text(body) else f"{i}: wrong text {text!r}"


async def wait_inflight_zero(router: Proc) -> None:
    deadline = time.monotonic() + 30  # a bound on a hang, not on the machine's speed
    while (n := get_json(router.url + "/health")["inflight"]) != 0:
        assert time.monotonic() < deadline, f"{n} requests still in flight"
        await asyncio.sleep(0.05)


async def test_500_concurrent_streams_complete_and_memory_stays_flat(tmp_path: Path) -> None:
    # The engine holds every first token until 500 generations run at once: the overlap is proven
    # by the engine, not hoped for from a pace (on a busy 2-core machine only 309 had overlapped).
    # Then a second before the first token: the router's count is read while all 500 are in it,
    # not only in the moment between the last arrival and the burst of answers (missed when the
    # router's loop, busy with that burst, answered the poll late: 0, 281, 309 seen).
    with SimProcess("load", "--hold-until-running", "500", "--hold-timeout", "40", "--ttft", "1") as sim:
        state = tmp_path / "state.json"
        write_state(state, [{"name": "load"}], [endpoint("load", sim.endpoint)])
        ctl = fake_controller(tmp_path, state).start("/test/usage")
        router = router_process(tmp_path, ctl).start("/health")
        try:
            rss = []
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                for round_ in range(6):
                    streams = asyncio.gather(*(one_stream(session, router.url, round_ * 1000 + i)
                                               for i in range(500)))
                    peak = 0
                    while not streams.done():
                        # Polled on the test's own loop: a blocking urlopen here stalled every
                        # stream of the round for as long as the router took to answer.
                        async with session.get(router.url + "/health",
                                               timeout=aiohttp.ClientTimeout(total=30)) as health:
                            peak = max(peak, (await health.json())["inflight"])
                        await asyncio.wait([streams], timeout=0.05)
                    problems = streams.result()
                    assert peak >= 400, f"only {peak} requests were in flight at once"
                    bad = [p for p in problems if p is not None]
                    assert not bad, bad[:5]
                    await wait_inflight_zero(router)
                    rss.append(router.rss_kb())
            # The first rounds grow the pools (connections, buffers); after that, nothing may leak.
            assert rss[-1] - rss[2] < 2048, f"router RSS per round (KiB): {rss}"
            metrics = await _text(router.url + "/metrics")
            assert 'llmgw_router_requests_total{model="load",replica="load-g1",status="200"} 3000.0' in metrics
        finally:
            router.stop()
            ctl.stop()


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        return await resp.text()


async def test_two_routers_survive_the_controller_and_follow_it_back(tmp_path: Path) -> None:
    with SimProcess("chat", "--tokens-per-second", "400") as a, SimProcess("chat") as b:
        state = tmp_path / "state.json"
        models = [{"name": "chat", "aliases": ["gpt-x"], "max": 2}]
        write_state(state, models, [endpoint("chat", a.endpoint, "chat-g1", names=("chat", "gpt-x"))])
        ctl = fake_controller(tmp_path, state).start("/test/usage")
        routers = [router_process(tmp_path, ctl, "--reconnect-max", "0.5").start("/health") for _ in range(2)]
        try:
            for r in routers:
                assert get_json(r.url + "/health")["endpoints"] == 1
            clients = [openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=10)
                       for r in routers]
            results: list[str] = []
            done = asyncio.Event()

            async def worker(n: int) -> None:
                c = clients[n % 2]
                while not done.is_set():
                    r = await c.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=4)
                    results.append(r.choices[0].message.content or "")

            async def answered(count: int) -> None:  # counted, not timed: a busy machine answers fewer a second
                deadline = time.monotonic() + 60  # a bound on a hang
                while len(results) < count and not load.done():
                    assert time.monotonic() < deadline, f"{len(results)} of {count} answers"
                    await asyncio.sleep(0.02)

            load = asyncio.gather(*(worker(n) for n in range(8)))
            await answered(20)
            ctl.kill()  # mid-load: SIGKILL, no goodbye
            killed = time.monotonic()
            killed_at = len(results)
            # At least 20 more answers, over at least 2 s: the routers go on through their reconnects.
            await answered(killed_at + 20)
            await asyncio.sleep(max(0.0, killed + 2.0 - time.monotonic()))
            done.set()
            await load  # any failed request would have raised here
            assert killed_at >= 20 and len(results) >= killed_at + 20
            assert len(set(results)) == 1  # same prompt, same deterministic answer, every time
            # Restarted, now with a second replica: both routers follow it again.
            write_state(state, models, [endpoint("chat", a.endpoint, "chat-g1", names=("chat", "gpt-x")),
                                        endpoint("chat", b.endpoint, "chat-g2", names=("chat", "gpt-x"))])
            ctl = fake_controller(tmp_path, state, port=ctl.port).start("/test/usage")
            deadline = time.monotonic() + 60  # a bound on a hang, not on the machine's speed
            while any(get_json(r.url + "/health")["endpoints"] != 2 for r in routers):
                assert time.monotonic() < deadline, "a router did not follow the restarted controller"
                await asyncio.sleep(0.1)
            for c in clients:
                for _ in range(4):
                    await c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "y"}])
                await c.close()
            # Both report their usage to the new controller.
            deadline = time.monotonic() + 60  # a bound on a hang (reports every 0.5 s)
            while len(get_json(ctl.url + "/test/usage")["routers"]) != 2:
                assert time.monotonic() < deadline, get_json(ctl.url + "/test/usage")
                await asyncio.sleep(0.1)
            assert "chat-g1" in get_json(ctl.url + "/test/usage")["last_used"]
        finally:
            for r in routers:
                r.stop()
            ctl.stop()
