"""The simulator as a real process, driven by the real openai client and by llmgw's own readers."""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from llmgw.agent.llmgw_agent import build_argv
from llmgw.catalog.model import Model, ModelName, Profile
from llmgw.engines.argv import engine_args
from llmgw.engines.health import Load, check_health, probe_ready, read_load
from llmgw.engines.testing import SimProcess, free_port
from tests.fixtures.streams import stream_raw

TPS = 40  # 25 ms between tokens


@pytest.fixture(scope="module")
def chat_sim() -> Iterator[SimProcess]:
    with SimProcess("sim-chat", "--alias", "gpt-x", "--tokens-per-second", str(TPS), "--max-running", "2") as sim:
        yield sim


@pytest.fixture(scope="module")
def embed_sim() -> Iterator[SimProcess]:
    with SimProcess("sim-embed", "--task", "embedding", "--embedding-dim", "32") as sim:
        yield sim


@pytest.fixture
def client(chat_sim: SimProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=chat_sim.endpoint + "/v1", api_key="x", timeout=10) as c:
        yield c


def post(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def metric(endpoint: str, name: str) -> float:
    with urllib.request.urlopen(endpoint + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def with_session(coro_fn: Any) -> Any:
    async with aiohttp.ClientSession() as session:
        return await coro_fn(session)


def run(coro_fn: Any) -> Any:
    return asyncio.run(with_session(coro_fn))


MESSAGES = [{"role": "user", "content": "Say something"}]


def test_health_is_503_loading_then_200_and_ready_only_after() -> None:
    # Loading for 8 s: time for a busy machine to ask while it loads (1.2 s was not always).
    with SimProcess("slow", "--startup-delay", "8") as sim:
        async def loading(session: aiohttp.ClientSession) -> tuple[Any, ...]:
            async with session.get(sim.endpoint + "/health") as resp:
                body = await resp.json()
            return (resp.status, body, await check_health(session, sim.endpoint),
                    await probe_ready(session, sim.endpoint, "slow", "chat", timeout=5))

        status, body, health, ready = run(loading)
        assert (status, health, ready) == (503, "loading", False)
        assert body == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}

        async def until_ok(session: aiohttp.ClientSession) -> tuple[str, bool]:
            deadline = time.monotonic() + 60
            while await check_health(session, sim.endpoint) != "ok" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return await check_health(session, sim.endpoint), await probe_ready(session, sim.endpoint, "slow", "chat")

        assert run(until_ok) == ("ok", True)


def test_models_lists_name_and_aliases(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["sim-chat", "gpt-x"]


def test_chat_completion_is_deterministic_and_echoes_the_served_name(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="gpt-x", messages=MESSAGES, max_tokens=5)
    again = client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=5)
    other = client.chat.completions.create(model="sim-chat", messages=[{"role": "user", "content": "Other"}],
                                           max_tokens=5)
    assert first.model == "sim-chat"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content
    assert len(first.choices[0].message.content.split()) == 5
    assert first.usage is not None and first.usage.completion_tokens == 5


def test_streamed_chat_arrives_in_events_of_one_to_three_tokens(client: openai.OpenAI, chat_sim: SimProcess) -> None:
    whole = client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=10)
    chunks = []
    stream = client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        chunks.append(chunk)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    # Its words are its tokens: 10 of them, in events of 1 to 3, as engines merge tokens.
    assert sorted({len(c.split()) for c in content}) <= [1, 2, 3] and sum(len(c.split()) for c in content) == 10
    assert len(content) < 10
    assert "".join(content) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])  # running counts only when asked for
    # Paced, not buffered: while the client holds the first event of a long answer (200 tokens at
    # 40 a second), the engine is still writing it; a buffered stream would arrive once done. Asked
    # of the engine, not timed on the client (CI saw a busy machine read 10 events at once).
    with client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=200, stream=True) as long:
        first = next(c for c in long if c.choices and c.choices[0].delta.content)
        assert first.choices[0].finish_reason is None
        assert metric(chat_sim.endpoint, "vllm:num_requests_running") >= 1


def test_running_counts_and_the_token_counters_count_what_was_written(client: openai.OpenAI,
                                                                      chat_sim: SimProcess) -> None:
    """vLLM's continuous_usage_stats: each event carries its answer's count so far. The
    simulator's generation counter counts the tokens of what it wrote (here: the words the client
    got), not the figure it reports in ``usage``; a stream the client leaves counts its written part."""
    written = metric(chat_sim.endpoint, "vllm:generation_tokens_total")
    chunks = list(client.chat.completions.create(
        model="sim-chat", messages=MESSAGES, max_tokens=7, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    words = {0: 0, 1: 0}
    for c in chunks[:-1]:
        assert c.usage is not None and c.choices
        words[c.choices[0].index] += len((c.choices[0].delta.content or "").split())
        assert c.usage.completion_tokens == words[c.choices[0].index]
        assert c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    assert words == {0: 7, 1: 7} and chunks[-1].usage.completion_tokens == 14
    whole = client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=5)
    got = len(whole.choices[0].message.content.split())
    assert metric(chat_sim.endpoint, "vllm:generation_tokens_total") - written == 14 + got == 19

    before = metric(chat_sim.endpoint, "vllm:generation_tokens_total")
    cancelled = metric(chat_sim.endpoint, "llmgw_sim_requests_cancelled_total")
    left = stream_raw(chat_sim.endpoint + "/v1/chat/completions",
                      {"model": "sim-chat", "messages": MESSAGES, "max_tokens": 200, "stream": True}, leave_after=2)
    deadline = time.monotonic() + 30
    while metric(chat_sim.endpoint, "llmgw_sim_requests_cancelled_total") == cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(chat_sim.endpoint, "llmgw_sim_requests_cancelled_total") == cancelled + 1
    # Everything it wrote before it saw the client leave reached the client (which read on).
    assert metric(chat_sim.endpoint, "vllm:generation_tokens_total") - before == len(left.content().split()) < 200


def test_completion_and_streamed_completion(client: openai.OpenAI) -> None:
    done = client.completions.create(model="sim-chat", prompt="Once upon a time", max_tokens=4)
    assert done.object == "text_completion" and len(done.choices[0].text.split()) == 4
    parts = [c.choices[0].text for c in client.completions.create(
        model="sim-chat", prompt="Once upon a time", max_tokens=4, stream=True) if c.choices]
    assert "".join(parts) == done.choices[0].text


def test_embeddings_are_deterministic_unit_vectors(embed_sim: SimProcess) -> None:
    with openai.OpenAI(base_url=embed_sim.endpoint + "/v1", api_key="x", timeout=10) as c:
        a = c.embeddings.create(model="sim-embed", input="hello world")  # the client asks for base64
        b = c.embeddings.create(model="sim-embed", input=["hello world", "bye"], encoding_format="float")
    va, vb, vc = a.data[0].embedding, b.data[0].embedding, b.data[1].embedding
    assert len(va) == 32 and math.isclose(sum(x * x for x in va), 1.0, rel_tol=1e-5)
    assert va == pytest.approx(vb, abs=1e-6)
    assert vc != pytest.approx(vb, abs=1e-3)
    assert [d.index for d in b.data] == [0, 1]


def test_unknown_model_is_404_in_openai_error_format(client: openai.OpenAI, chat_sim: SimProcess) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    status, body = post(chat_sim.endpoint + "/v1/chat/completions",
                        json.dumps({"model": "nope", "messages": MESSAGES}).encode())
    assert status == 404
    assert set(body["error"]) >= {"message", "type", "code"} and "nope" in body["error"]["message"]


def test_malformed_json_is_400(chat_sim: SimProcess) -> None:
    status, body = post(chat_sim.endpoint + "/v1/chat/completions", b'{"model": "sim-chat", "messages": [')
    assert status == 400 and body["error"]["type"] == "BadRequestError"


def test_wrong_api_for_the_task_is_400(chat_sim: SimProcess, embed_sim: SimProcess) -> None:
    assert post(chat_sim.endpoint + "/v1/embeddings", b'{"model": "sim-chat", "input": "x"}')[0] == 400
    assert post(embed_sim.endpoint + "/v1/completions", b'{"model": "sim-embed", "prompt": "x"}')[0] == 400


def test_client_disconnect_mid_stream_cancels_the_request(chat_sim: SimProcess) -> None:
    before = metric(chat_sim.endpoint, "llmgw_sim_requests_cancelled_total")
    body = {"model": "sim-chat", "messages": MESSAGES, "max_tokens": 200, "stream": True}

    async def hang_up(session: aiohttp.ClientSession) -> bytes:
        resp = await session.post(chat_sim.endpoint + "/v1/chat/completions", json=body)
        first = await resp.content.readline()
        resp.close()  # drops the connection mid-stream
        return first

    assert run(hang_up).startswith(b"data: ")
    deadline = time.monotonic() + 3
    while metric(chat_sim.endpoint, "llmgw_sim_requests_cancelled_total") <= before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(chat_sim.endpoint, "llmgw_sim_requests_cancelled_total") == before + 1
    assert metric(chat_sim.endpoint, "vllm:num_requests_running") == 0


def test_probe_ready_and_health_of_ready_and_absent_engines(chat_sim: SimProcess, embed_sim: SimProcess) -> None:
    absent = f"http://127.0.0.1:{free_port()}"

    async def probes(session: aiohttp.ClientSession) -> list[Any]:
        return [
            await probe_ready(session, chat_sim.endpoint, "sim-chat", "chat"),
            await probe_ready(session, embed_sim.endpoint, "sim-embed", "embedding"),
            await probe_ready(session, chat_sim.endpoint, "sim-chat", "embedding"),
            await probe_ready(session, chat_sim.endpoint, "other", "chat"),
            await probe_ready(session, absent, "sim-chat", "chat", timeout=1),
            await check_health(session, chat_sim.endpoint),
            await check_health(session, absent, timeout=1),
            await read_load(session, absent, "sim", timeout=1),
        ]

    assert run(probes) == [True, True, False, False, False, "ok", "down", None]


def test_read_load_sees_requests_in_flight_and_waiting() -> None:
    body = {"model": "sim-chat", "messages": MESSAGES, "max_tokens": 24, "stream": True}
    full = Load(running=2, waiting=2, kv_cache_usage=1.0)  # 4 requests, 2 slots (--max-running 2)

    async def busy(sim: SimProcess, session: aiohttp.ClientSession) -> tuple[Load | None, Load | None]:
        async def one() -> None:
            async with session.post(sim.endpoint + "/v1/chat/completions", json=body) as resp:
                await resp.read()

        # Two tokens a second: the four requests hold the state read here for 12 s, and the read
        # ends as soon as it sees it (a busy machine may take seconds to start them all).
        tasks = [asyncio.create_task(one()) for _ in range(4)]
        deadline = time.monotonic() + 10
        during = queue(await read_load(session, sim.endpoint, "sim"))
        while during != full and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            during = queue(await read_load(session, sim.endpoint, "sim"))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 30  # the engine counts the hang-ups as they reach it
        after = await read_load(session, sim.endpoint, "sim")
        while queue(after) != Load(0, 0, 0.0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            after = await read_load(session, sim.endpoint, "sim")
        return during, after

    with SimProcess("sim-chat", "--tokens-per-second", "2", "--max-running", "2") as sim:
        during, after = run(lambda session: busy(sim, session))
    assert during == full
    assert queue(after) == Load(running=0, waiting=0, kv_cache_usage=0.0)
    # The simulator also counts its prefix cache as vLLM does: every prompt token looked up.
    assert after is not None and after.prefix_queries is not None and after.prefix_queries >= 4


def queue(load: Load | None) -> Load | None:
    """Only the queue and KV figures (the prefix-cache totals grow with every request)."""
    return None if load is None else Load(load.running, load.waiting, load.kv_cache_usage)


def test_sigterm_exits_quickly_even_with_a_stream_open() -> None:
    with SimProcess("bye", "--tokens-per-second", "10") as sim:
        body = {"model": "bye", "messages": MESSAGES, "max_tokens": 1000, "stream": True}

        async def stop_mid_stream(session: aiohttp.ClientSession) -> float:
            async with session.post(sim.endpoint + "/v1/chat/completions", json=body) as resp:
                await resp.content.readline()
                started = time.monotonic()
                sim.terminate()
                await asyncio.to_thread(sim.wait, 60)
                return time.monotonic() - started

        # The simulator gives open streams 0.2 s, then cuts them; what this rules out is waiting
        # for the stream to end (100 s at this pace), so the bound is far from both.
        assert run(stop_mid_stream) < 30
        assert sim.wait(timeout=1) == 0


def test_argv_built_for_a_sim_profile_runs_through_the_agents_substitution() -> None:
    profile = Profile(name="sim", priority=0, engine="sim", gpus=1, args=("--max-tokens-default", "3"))
    model = Model(name=ModelName("sim-chat"), source="/var/lib/llmgw/sim/tiny", size_gb=0.1, profiles=(profile,),
                  aliases=("gpt-4o-mini",))
    port = free_port()
    argv = build_argv(("python", "-m", "llmgw.engines.sim"), engine_args(model, profile),
                      {"port": str(port), "weights": "/var/lib/llmgw/sim/tiny", "host": "127.0.0.1"})
    assert argv[:3] == ["python", "-m", "llmgw.engines.sim"]
    # SimProcess supplies the interpreter, model, host and port itself: pass the rest through.
    rest = argv[3:]
    assert rest[:6] == ["--model", "sim-chat", "--host", "127.0.0.1", "--port", str(port)]
    with SimProcess("sim-chat", *rest[6:], port=port) as sim, \
            openai.OpenAI(base_url=sim.endpoint + "/v1", api_key="x", timeout=10) as c:
        answer = c.chat.completions.create(model="sim-chat", messages=MESSAGES)
        assert len(answer.choices[0].message.content.split()) == 3
        assert answer.choices[0].finish_reason == "stop"


def test_the_completion_limit_is_read_as_vllm_reads_it(client: openai.OpenAI) -> None:
    """vLLM's rule, not the most generous field: chat takes ``max_completion_tokens or
    max_tokens`` (a 0 falls through), completions ``max_tokens`` alone, and llama.cpp's
    ``n_predict`` is nobody's limit here. A router that reserves from a field vLLM does not read
    is caught by what the simulator writes (review 2: ``n_predict: 5`` alone was served to the
    context)."""
    def chat(**extra: object) -> int:
        r = client.chat.completions.create(model="sim-chat", messages=MESSAGES, extra_body=extra)
        assert r.usage is not None
        return r.usage.completion_tokens

    assert chat(max_completion_tokens=3, max_tokens=9) == 3
    assert chat(max_completion_tokens=0, max_tokens=9) == 9
    assert chat(n_predict=2, max_tokens=5) == 5
    assert chat(n_predict=2) == chat() == chat(max_completion_tokens=0) == 16  # the default
    done = client.completions.create(model="sim-chat", prompt="Once upon a time", max_tokens=4,
                                     extra_body={"max_completion_tokens": 1, "n_predict": 1})
    assert done.usage is not None and done.usage.completion_tokens == 4
