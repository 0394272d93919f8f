"""The router on a real port, driven by the real openai client, in front of real simulated engines."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.catalog.model import Catalog
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from tests.router.conftest import client, endpoint, serving, sim_metric
from tests.router.fake_controller import model

CATALOG = Catalog(models=(
    model("chat", aliases=("gpt-x",)),
    model("stream"),
    model("embed", task="embedding"),
    model("big", fallbacks=("chat",), max=2),
    model("cold", max=1),
    model("off", max=0),
))
HELLO = [{"role": "user", "content": "Hello there"}]


def make_router(chat_sim: SimProcess, *more, **config: float) -> Router:
    router = Router(config=RouterConfig(**config))  # type: ignore[arg-type]
    router.set_catalog(CATALOG)
    router.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x")), *more])
    return router


async def direct_chat(sim: SimProcess, name: str) -> str:
    async with openai.AsyncOpenAI(base_url=sim.endpoint + "/v1", api_key="x", max_retries=0) as c:
        r = await c.chat.completions.create(model=name, messages=HELLO)
    return r.choices[0].message.content or ""


async def test_models_lists_every_name_with_readiness(chat_sim: SimProcess, embed_sim: SimProcess) -> None:
    router = make_router(chat_sim, endpoint("embed", embed_sim.endpoint, task="embedding"))
    async with serving(router) as base, client(base) as c:
        page = await c.models.list()
        listed = {m.id: m.model_extra for m in page.data}
        assert set(listed) == {"chat", "gpt-x", "stream", "embed", "big", "cold", "off"}
        assert listed["gpt-x"] == {"root": "chat", "task": "chat", "ready": True}
        assert listed["embed"]["ready"] is True and listed["embed"]["task"] == "embedding"
        assert listed["cold"]["ready"] is False and listed["big"]["ready"] is False
        one = await c.models.retrieve("gpt-x")
        assert one.id == "gpt-x" and one.model_extra["root"] == "chat"
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("nope")


async def test_chat_by_name_and_alias_matches_the_engine(chat_sim: SimProcess) -> None:
    expected = await direct_chat(chat_sim, "chat")
    async with serving(make_router(chat_sim)) as base, client(base) as c:
        for name in ("chat", "gpt-x"):
            raw = await c.chat.completions.with_raw_response.create(model=name, messages=HELLO)
            assert raw.headers["x-llmgw-model"] == "chat"
            answer = raw.parse()
            assert answer.choices[0].message.content == expected
            assert answer.model == "chat"  # the engine was asked for its canonical name


async def test_streamed_chunks_arrive_as_produced(chat_sim: SimProcess, stream_sim: SimProcess) -> None:
    async def timed(base: str, name: str) -> tuple[float, list[float], str]:
        async with client(base) as c:
            await c.models.list()  # the connection is open: time only the request
            t0 = time.monotonic()
            stream = await c.chat.completions.create(model=name, messages=HELLO, stream=True)
            times, text = [], ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.monotonic() - t0)
                    text += chunk.choices[0].delta.content
        return times[0], times, text

    router = make_router(chat_sim, endpoint("stream", stream_sim.endpoint))
    async with serving(router) as base:
        # Best of two each, so a scheduling hiccup on a busy test machine is not read as the router's.
        direct = [await timed(stream_sim.endpoint, "stream") for _ in range(2)]
        routed = [await timed(base, "stream") for _ in range(2)]
    direct_first, direct_text, direct_events = min(d[0] for d in direct), direct[0][2], len(direct[0][1])
    first, times, text = min(routed)
    # Event for event what the engine wrote: 16 tokens (its words), 1 to 3 in each event.
    assert text == direct_text and len(text.split()) == 16 and len(times) == direct_events
    # --ttft 0.2 then 20 tokens/s, an event written with its last token: the first chunk is not
    # held back for the rest...
    assert 0.2 <= first
    assert first - direct_first < 0.05
    # ...and the others follow at the engine's pace, not in one burst at the end.
    assert times[-1] - times[0] > 0.6
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert sorted(gaps)[len(gaps) // 2] > 0.03


async def test_completions_and_embeddings(chat_sim: SimProcess, embed_sim: SimProcess) -> None:
    router = make_router(chat_sim, endpoint("embed", embed_sim.endpoint, task="embedding"))
    async with serving(router) as base, client(base) as c:
        done = await c.completions.create(model="gpt-x", prompt="Once upon a time", max_tokens=5)
        assert done.choices[0].finish_reason == "length" and len(done.choices[0].text.split()) == 5
        emb = await c.embeddings.create(model="embed", input=["one", "two"])
        assert [len(d.embedding) for d in emb.data] == [16, 16]
        with pytest.raises(openai.BadRequestError, match="embedding model"):
            await c.chat.completions.create(model="embed", messages=HELLO)
        with pytest.raises(openai.BadRequestError, match="chat model"):
            await c.embeddings.create(model="chat", input="x")


async def test_fallback_serves_and_wakes_the_primary(chat_sim: SimProcess) -> None:
    woken: list[str] = []
    router = make_router(chat_sim)
    router.wake = woken.append
    async with serving(router) as base, client(base) as c:
        raw = await c.chat.completions.with_raw_response.create(model="big", messages=HELLO)
        assert raw.status_code == 200 and raw.headers["x-llmgw-model"] == "chat"
        assert raw.parse().model == "chat"
    assert woken == ["big"]
    assert router.usage.demand()["big"].held == 1  # demand for the primary, so the control plane starts one
    assert router.usage.demand()["big"].inflight == 0


@pytest.mark.parametrize("dead", ["closed port", "killed engine"])
async def test_retry_on_another_replica_when_one_is_dead(chat_sim: SimProcess, dead: str) -> None:
    if dead == "killed engine":
        killed = SimProcess("chat", "--alias", "gpt-x").start()
        killed._proc.kill()  # type: ignore[union-attr]
        killed.wait(5)
        url = killed.endpoint
        killed.stop()
    else:
        url = f"http://127.0.0.1:{free_port()}"
    # The dead one comes first (lower priority value), so the first request meets it before the live one.
    router = make_router(chat_sim, endpoint("chat", url, "dead", names=("chat", "gpt-x"), priority=-1))
    async with serving(router) as base, client(base) as c:
        for _ in range(3):
            r = await c.chat.completions.create(model="gpt-x", messages=HELLO)
            assert r.choices[0].message.content
    dead_one = router.table.upstreams["dead"]
    assert dead_one.failures == 1  # tried once, then cooled down: the next requests skip it
    assert dead_one.cooldown_until > time.monotonic()
    assert router.requests_in_flight() == 0


async def test_a_dead_primary_fails_over_to_its_fallback_and_is_then_skipped(chat_sim: SimProcess) -> None:
    router = make_router(chat_sim, endpoint("big", f"http://127.0.0.1:{free_port()}", "big-dead"))
    async with serving(router) as base, client(base) as c:
        for _ in range(3):
            raw = await c.chat.completions.with_raw_response.create(model="big", messages=HELLO)
            assert raw.headers["x-llmgw-model"] == "chat"
    assert router.table.upstreams["big-dead"].failures == 1  # cooling: the next requests went straight on
    assert "big" not in router.usage.demand()  # it has a replica (a sick one): no wake for it


async def test_every_replica_dead_is_a_clear_502() -> None:
    router = Router()
    router.set_catalog(CATALOG)
    router.set_endpoints([endpoint("chat", f"http://127.0.0.1:{free_port()}", "a"),
                          endpoint("chat", f"http://127.0.0.1:{free_port()}", "b")])
    async with serving(router) as base, client(base) as c:
        with pytest.raises(openai.APIStatusError) as err:
            await c.chat.completions.create(model="chat", messages=HELLO)
    assert err.value.status_code == 502
    assert "2 attempt(s) failed" in err.value.message and "cannot connect" in err.value.message
    assert err.value.body["code"] == "upstream_failed"  # type: ignore[index]


async def test_first_byte_timeout() -> None:
    with SimProcess("slow", "--ttft", "60") as slow:
        router = Router(config=RouterConfig(first_byte_timeout=0.3, retries=0))
        router.set_catalog(Catalog(models=(model("slow"),)))
        router.set_endpoints([endpoint("slow", slow.endpoint)])
        async with serving(router) as base, client(base) as c:
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as err:
                await c.chat.completions.create(model="slow", messages=HELLO, stream=True)
            # Cut at the router's 0.3 s, far from the engine's 60 s (a bound no busy machine trips).
            assert err.value.status_code == 504 and time.monotonic() - t0 < 20


async def test_api_keys(chat_sim: SimProcess, embed_sim: SimProcess) -> None:
    keys = KeyRing.from_entries([
        {"name": "admin", "sha256": hash_key("sk-all"), "models": ["*"]},
        {"name": "team-a", "sha256": hash_key("sk-team"), "models": ["gpt-x"]},
    ])
    router = Router(keys=keys)
    router.set_catalog(CATALOG)
    router.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x")),
                          endpoint("embed", embed_sim.endpoint, task="embedding")])
    async with serving(router) as base:
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/chat/completions", json={"model": "chat", "messages": HELLO}) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
        async with client(base, "sk-wrong") as c:
            with pytest.raises(openai.AuthenticationError, match="not valid"):
                await c.chat.completions.create(model="chat", messages=HELLO)
            with pytest.raises(openai.AuthenticationError):
                await c.models.list()
        async with client(base, "sk-team") as c:
            # The key lists the alias; the canonical name is the same model.
            assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
            with pytest.raises(openai.PermissionDeniedError, match="team-a"):
                await c.embeddings.create(model="embed", input="x")
            assert {m.id for m in (await c.models.list()).data} == {"chat", "gpt-x"}
        async with client(base, "sk-all") as c:
            assert (await c.embeddings.create(model="embed", input="x")).data


async def test_request_errors_in_openai_format(chat_sim: SimProcess) -> None:
    router = Router(config=RouterConfig(body_limit=2048))
    router.set_catalog(CATALOG)
    router.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x"))])
    async with serving(router) as base:
        async with client(base) as c:
            with pytest.raises(openai.NotFoundError, match="`gpt-9` does not exist") as err:
                await c.chat.completions.create(model="gpt-9", messages=HELLO)
            assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
            with pytest.raises(openai.APIStatusError) as err:
                await c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x" * 5000}])
            assert err.value.status_code == 413 and "2048 bytes" in err.value.message
        async with aiohttp.ClientSession() as s:
            async def chunked_upload():  # noqa: ANN202 - no Content-Length: the limit applies while reading
                yield b'{"model": "chat", "messages": [{"role": "user", "content": "'
                for _ in range(10):
                    yield b"x" * 500
                yield b'"}]}'

            async with s.post(base + "/v1/chat/completions", data=chunked_upload(),
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"
            for body, status, code in ((b'{"model": "chat", "messages": [', 400, "invalid_json"),
                                       (b'["chat"]', 400, "invalid_json"),
                                       (b'{"messages": []}', 400, "missing_model")):
                async with s.post(base + "/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as resp:
                    answer = await resp.json()
                    assert resp.status == status and answer["error"]["code"] == code, answer
                    assert set(answer["error"]) == {"message", "type", "param", "code"}


async def test_client_disconnect_cancels_upstream(chat_sim: SimProcess, stream_sim: SimProcess) -> None:
    router = make_router(chat_sim, endpoint("stream", stream_sim.endpoint))
    before = sim_metric(stream_sim.endpoint, "llmgw_sim_requests_cancelled_total")
    async with serving(router) as base:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(base + "/v1/chat/completions",
                                json={"model": "stream", "messages": HELLO, "stream": True})
            first = await resp.content.readany()
            assert first.startswith(b"data: ")
            assert router.requests_in_flight() == 1
            resp.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 3
        while sim_metric(stream_sim.endpoint, "llmgw_sim_requests_cancelled_total") == before:
            assert time.monotonic() < deadline, "the engine never saw the request cancelled"
            await asyncio.sleep(0.05)
        assert router.requests_in_flight() == 0


async def test_scale_from_zero_holds_until_a_replica_is_ready(chat_sim: SimProcess) -> None:
    woken: list[str] = []
    router = make_router(chat_sim)
    router.wake = woken.append
    async with serving(router) as base, client(base) as c:
        task = asyncio.create_task(c.chat.completions.with_raw_response.create(model="cold", messages=HELLO))
        while not router.usage.demand().get("cold"):
            await asyncio.sleep(0.01)
        assert woken == ["cold"] and router.usage.demand()["cold"].held == 1
        await asyncio.sleep(0.2)
        assert not task.done()
        # The control plane publishes the new replica: the held request goes to it.
        router.set_endpoints([endpoint("chat", chat_sim.endpoint, names=("chat", "gpt-x")),
                              endpoint("cold", chat_sim.endpoint)])
        raw = await asyncio.wait_for(task, 5)
        assert raw.headers["x-llmgw-model"] == "cold" and raw.parse().choices[0].message.content
    assert "cold" not in router.usage.demand()


async def test_hold_times_out_with_retry_after(chat_sim: SimProcess) -> None:
    router = make_router(chat_sim, hold_timeout=0.3)
    async with serving(router) as base, client(base) as c:
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            await c.chat.completions.create(model="cold", messages=HELLO)
        assert err.value.status_code == 503 and time.monotonic() - t0 >= 0.3
        assert err.value.response.headers["Retry-After"] == "5"
        assert "No ready replica of `cold`" in err.value.message and "waited" in err.value.message
        with pytest.raises(openai.APIStatusError, match="switched off") as err:
            await c.chat.completions.create(model="off", messages=HELLO)
        assert err.value.status_code == 503


async def test_equal_replicas_share_the_load(chat_sim: SimProcess) -> None:
    with SimProcess("chat", "--alias", "gpt-x") as other:
        router = make_router(chat_sim, endpoint("chat", other.endpoint, "chat-g2", names=("chat", "gpt-x")))
        async with serving(router) as base, client(base) as c:
            for _ in range(40):
                await c.chat.completions.create(model="chat", messages=HELLO)
            async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
                text = await resp.text()
    served = {s.labels["replica"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "llmgw_router_requests_total"}
    # Sequential requests find both idle: ties are broken at random, never always the first.
    assert served.get("chat-g1", 0) >= 5 and served.get("chat-g2", 0) >= 5, served


async def test_metrics_parse(chat_sim: SimProcess, stream_sim: SimProcess) -> None:
    router = make_router(chat_sim, endpoint("stream", stream_sim.endpoint))
    async with serving(router) as base, client(base) as c:
        await c.chat.completions.create(model="gpt-x", messages=HELLO)
        await c.chat.completions.create(model="big", messages=HELLO)
        stream = await c.chat.completions.create(model="stream", messages=HELLO, stream=True, max_tokens=2)
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="nope", messages=HELLO)
        async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
            text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("llmgw_router_requests_total", (("model", "chat"), ("replica", "chat-g1"), ("status", "200")))] == 1
    assert samples[("llmgw_router_requests_total", (("model", "big"), ("replica", "chat-g1"), ("status", "200")))] == 1
    assert samples[("llmgw_router_requests_total", (("model", "unknown"), ("replica", ""), ("status", "404")))] == 1
    assert samples[("llmgw_router_fallbacks_total", (("fallback", "chat"), ("model", "big")))] == 1
    assert samples[("llmgw_router_time_to_first_token_seconds_count", (("model", "stream"),))] == 1
    assert samples[("llmgw_router_request_duration_seconds_count", (("model", "chat"),))] == 1
    assert samples[("llmgw_router_inflight", (("model", "chat"), ("replica", "chat-g1")))] == 0
    assert samples[("llmgw_router_ready_replicas", (("model", "stream"),))] == 1
    assert {"llmgw_router_retries", "llmgw_router_held", "llmgw_router_held_now"} <= set(families)


async def test_the_engines_own_queue_is_a_metric() -> None:
    """What the engine says it runs and queues (every client's, from its /metrics) is a gauge per
    replica: the operator sees a replica's queue, not only this router's share of it."""
    from llmgw.engines.testing import SimProcess as Sim

    with Sim("chat", "--max-running", "1", "--ttft", "60") as sim:
        router = make_router(sim, load_interval=0.1)
        async with serving(router) as base, client(base) as c:
            held = [asyncio.create_task(c.chat.completions.create(model="chat", messages=HELLO)) for _ in range(2)]
            try:
                seen: dict[str, float] = {}
                for _ in range(200):  # until the engine has said so (a bound, not a timing)
                    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
                        text = await resp.text()
                    seen = {sample.labels["state"]: sample.value for f in text_string_to_metric_families(text)
                            for sample in f.samples if sample.name == "llmgw_router_engine_requests"
                            and sample.labels["replica"] == "chat-g1"}
                    if seen == {"running": 1.0, "waiting": 1.0}:
                        break
                    await asyncio.sleep(0.05)
                assert seen == {"running": 1.0, "waiting": 1.0}
            finally:
                for t in held:
                    t.cancel()
                await asyncio.gather(*held, return_exceptions=True)
