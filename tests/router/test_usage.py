"""Usage per key and model (issue 18, first part): counted from what the engine reports, with the
real openai client through the router in front of real simulated engines; and the pure parts."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.catalog.model import Catalog
from llmgw.engines.testing import SimProcess
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from llmgw.router.usage import ask_for_usage, content_events, reported_usage, strip_usage_events, with_fields
from tests.router.conftest import client, endpoint, serving
from tests.router.fake_controller import model
from tests.router.test_deliveries import engine

MESSAGES = [{"role": "system", "content": "You count words."}, {"role": "user", "content": "one two three four"}]


def make(chat_sim: SimProcess, stream_sim: SimProcess | None = None, keys: KeyRing | None = None) -> Router:
    router = Router(keys=keys, config=RouterConfig())
    router.set_catalog(Catalog(models=(model("chat"), model("stream"))))
    eps = [endpoint("chat", chat_sim.endpoint)]
    if stream_sim is not None:
        eps.append(endpoint("stream", stream_sim.endpoint))
    router.set_endpoints(eps)
    return router


# --- the pure parts ----------------------------------------------------------------------------

def test_the_usage_event_is_asked_for_and_taken_out_again() -> None:
    body = {"model": "m", "stream": True, "messages": MESSAGES}
    raw = json.dumps(body).encode()
    asked = ask_for_usage(raw, body)
    assert json.loads(asked) == {**body, "stream_options": {"include_usage": True}}
    assert asked.endswith(raw[1:])  # the client's bytes kept as they were
    other = {**body, "stream_options": {"continuous_usage_stats": False}}
    assert json.loads(ask_for_usage(json.dumps(other).encode(), other))["stream_options"] == {
        "continuous_usage_stats": False, "include_usage": True}
    wanted = {**body, "stream_options": {"include_usage": True}}
    assert ask_for_usage(json.dumps(wanted).encode(), wanted) == json.dumps(wanted).encode()
    chunk = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
             b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    assert strip_usage_events(chunk) == (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
                                         b"data: [DONE]\n\n")
    assert reported_usage(chunk) == (5, 2)
    spoken = b'data: {"choices":[{"delta":{"content":"the \\"usage\\": {\\"prompt_tokens\\": 99"}}]}\n\n'
    assert strip_usage_events(spoken) == spoken and reported_usage(spoken) is None
    assert content_events(b'{"delta":{"role":"assistant","content":""}}{"delta":{"content":"a"}}'
                          b'{"choices":[{"text":"b"}]}') == 2
    # What a reasoning model thinks and a tool call's arguments are generated tokens too.
    assert content_events(b'{"delta":{"reasoning_content":"Let"}}{"delta":{"reasoning":" me"}}'
                          b'{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"x"}}]}}'
                          b'{"delta":{"content":"said \\"content\\": \\"no"}}') == 4


# --- through the router ------------------------------------------------------------------------

async def test_whole_and_streamed_answers_count_what_the_engine_reported(chat_sim: SimProcess) -> None:
    router = make(chat_sim)
    async with serving(router) as base, client(base) as c:
        whole = await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=7)
        # Streamed without asking for usage: every chunk the client sees has choices (the usage
        # event the router asked for is not passed on), and the ledger still has the engine's counts.
        chunks = [ch async for ch in await c.chat.completions.create(model="chat", messages=MESSAGES,
                                                                     max_tokens=5, stream=True)]
        assert chunks and all(ch.choices for ch in chunks) and all(ch.usage is None for ch in chunks)
        # Asked for: passed on, and the same numbers counted.
        asked = [ch async for ch in await c.chat.completions.create(
            model="chat", messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True})]
        assert asked[-1].usage is not None and asked[-1].choices == []
        # Usage per key is served behind the admin token only (Router.metrics_app, test_metrics_surface).
        metrics = generate_latest(router.metrics.tenants).decode()
    assert whole.usage is not None
    prompt = whole.usage.prompt_tokens
    assert asked[-1].usage.prompt_tokens == prompt and asked[-1].usage.completion_tokens == 4
    u = router.usage()[("", "chat")]
    assert (u.requests, u.errors, u.counted_from_stream) == (3, 0, 0)
    assert u.prompt_tokens == 3 * prompt
    assert u.completion_tokens == whole.usage.completion_tokens + 5 + 4 == 16
    samples = {(s.labels["model"], s.labels["kind"]): s.value for f in text_string_to_metric_families(metrics)
               for s in f.samples if s.name == "llmgw_router_usage_tokens_total"}
    assert samples[("chat", "prompt")] == 3 * prompt and samples[("chat", "completion")] == 16


async def test_a_stream_the_client_leaves_counts_what_was_produced(chat_sim: SimProcess,
                                                                   stream_sim: SimProcess) -> None:
    router = make(chat_sim, stream_sim)
    async with serving(router) as base, client(base) as c:
        stream = await c.chat.completions.create(model="stream", messages=MESSAGES, max_tokens=200, stream=True)
        got = 0
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                got += 1
            if got == 3:
                break
        await stream.close()
        for _ in range(50):
            if ("", "stream") in router.usage():
                break
            await asyncio.sleep(0.05)
    u = router.usage()[("", "stream")]
    assert (u.requests, u.errors, u.counted_from_stream) == (1, 1, 1)
    # Produced by the engine and read by the router before the client left: at least what the
    # client saw, far fewer than the 200 asked for; the prompt is not known without the report.
    assert 3 <= u.completion_tokens < 20 and u.prompt_tokens == 0


async def test_a_client_that_hangs_up_at_the_end_marker_was_served_whole() -> None:
    """The sync openai client closes the connection as soon as it reads ``data: [DONE]``; an
    engine whose body's last bytes come later (here 1 s) must not turn that into an abort:
    the engine's usage is counted, no error, status 200."""
    usage = b'data: {"id":"u","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":2}}\n\n'
    events = [b'data: {"id":"u","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
              b'data: {"id":"u","choices":[{"index":0,"delta":{"content":"!"},"finish_reason":"stop"}]}\n\n',
              usage + b"data: [DONE]\n\n"]

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for e in events:
            w.write(b"%x\r\n%s\r\n" % (len(e), e))
            await w.drain()
        await asyncio.sleep(1.0)  # the body's end, held back
        w.write(b"0\r\n\r\n")
        await w.drain()

    async with engine(answer) as (url, _seen):
        router = Router(config=RouterConfig())
        router.set_catalog(Catalog(models=(model("chat"),)))
        router.set_endpoints([endpoint("chat", url)])
        async with serving(router) as base:
            def ask() -> list[str]:
                c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=10)
                s = c.chat.completions.create(model="chat", messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True})
                return [ch.choices[0].delta.content or "" if ch.choices else "usage" for ch in s]
            assert await asyncio.to_thread(ask) == ["hi", "!", "usage"]
            await asyncio.sleep(0.3)  # the router's handler, cancelled by the hang-up, has ended
            async with aiohttp.ClientSession() as http, http.get(base + "/metrics") as r:
                metrics = await r.text()
    u = router.usage()[("", "chat")]
    assert (u.requests, u.errors, u.counted_from_stream, u.prompt_tokens, u.completion_tokens) == (1, 0, 0, 11, 2)
    statuses = {s.labels["status"]: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                if s.name == "llmgw_router_requests_total"}
    assert statuses == {"200": 1.0}


async def test_usage_is_kept_per_key(chat_sim: SimProcess) -> None:
    keys = KeyRing.from_entries([{"name": "team-a", "sha256": hash_key("sk-a"), "models": ["*"]},
                                 {"name": "team-b", "sha256": hash_key("sk-b"), "models": ["*"]}])
    router = make(chat_sim, keys=keys)
    async with serving(router) as base, client(base, "sk-a") as a, client(base, "sk-b") as b:
        await a.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=3)
        await a.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=3)
        await b.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=9)
    usage = router.usage()
    assert usage[("team-a", "chat")].requests == 2 and usage[("team-a", "chat")].completion_tokens == 6
    assert usage[("team-b", "chat")].requests == 1 and usage[("team-b", "chat")].completion_tokens == 9


def test_only_whole_usage_events_are_stripped_whatever_the_read_boundaries() -> None:
    stream = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
              b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
              b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
              b"data: [DONE]\n\n")
    want = stream.replace(b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n', b"")
    for cut in range(1, len(stream)):
        out = strip_usage_events(stream[:cut]) + strip_usage_events(stream[cut:])
        events = [e for e in out.split(b"\n\n") if e]
        # Every event the client gets is whole JSON (or [DONE]); the usage event is gone unless a
        # read boundary split it, in which case it is passed on whole.
        assert out in (want, stream), cut
        assert all(e == b"data: [DONE]" or json.loads(e[6:]) for e in events), cut
    # The word "usage" as a value (a token of prompt_logprobs) is not the usage object.
    whole = b'{"usage":{"prompt_tokens":7,"completion_tokens":3},"prompt_logprobs":[{"1":{"decoded_token":"usage"}}]}'
    assert reported_usage(whole) == (7, 3)


@pytest.mark.parametrize(("raw", "fast"), [
    (b'{"model": "chat", "max_tokens": 16, "messages": []}', True),  # the usual body: the others written in
    (b'\xef\xbb\xbf {"model": "chat", "max_tokens": 16}', True),  # a BOM and a space before the brace
    (b'{"model": "chat", "max_tokens": "16"}', False),  # a string: written again as a number
    (b'{"model": "chat", "max_tokens": 1, "max_tokens": 16}', False),  # twice: a parser may keep the first
    (b'{"model": "chat", "max_tokens": 16, "messages": [{"content": "\\u0022n_predict\\u0022"}]}', False),
    (b'{"model": "chat", "max_tokens": 16, "messages": [{"content": "say \\"n_predict\\""}]}', True),  # text
    (b'{"model": "chat", "max_tokens": 500}', False),  # another number than the one reserved
])
def test_with_fields_sends_every_limit_field_once_with_the_reserved_number(raw: bytes, fast: bool) -> None:
    """Every limited request goes through this: whatever the body, the engine reads each field as
    the router reserved it, exactly once; the usual body keeps its bytes after the brace."""
    body = json.loads(raw)
    fields = {"max_tokens": 16, "max_completion_tokens": 16, "n_predict": 16, "stream_options": {"a": [1]}}
    out = with_fields(raw, body, fields)
    assert json.loads(out) == {**body, **fields}
    assert len(json.loads(out, object_pairs_hook=lambda kv: kv)) == len({**body, **fields})  # no key twice
    rest = raw[raw.index(b"{") + 1:]
    assert out.endswith(rest) == fast
