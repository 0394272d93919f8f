"""Usage per key and model (issue 18, first part): counted from what the engine reports, with the
real openai client through the router in front of real simulated engines; and the pure parts."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import aiohttp
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.catalog.model import Catalog
from llmgw.engines.testing import SimProcess
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from llmgw.router.usage import (
    Meter,
    Relay,
    content_events,
    relay_stream,
    reported_usage,
    whole_events,
    with_fields,
)
from tests.fixtures.streams import stream_raw
from tests.router.conftest import client, endpoint, ledger_usage, serving, sim_metric
from tests.router.fake_controller import model
from tests.router.test_deliveries import engine

MESSAGES = [{"role": "system", "content": "You count words."}, {"role": "user", "content": "one two three four"}]


def strip_usage_events(chunk: bytes) -> bytes:
    """What the router passes on of a stream piece to a client that asked for no usage (the engine
    was asked for it on the client's behalf): the relay the request path builds."""
    _, relay = relay_stream(b'{"stream": true}', {"stream": True}, timings=False)
    assert relay.strip is not None
    return relay.strip(chunk)


def make(chat_sim: SimProcess, stream_sim: SimProcess | None = None, keys: KeyRing | None = None) -> Router:
    router = Router(keys=keys, config=RouterConfig())
    router.set_catalog(Catalog(models=(model("chat"), model("stream"))))
    eps = [endpoint("chat", chat_sim.endpoint)]
    if stream_sim is not None:
        eps.append(endpoint("stream", stream_sim.endpoint))
    router.set_endpoints(eps)
    return router


# --- the pure parts ----------------------------------------------------------------------------

def test_a_streams_running_counts_are_asked_for_and_taken_out_again() -> None:
    body = {"model": "m", "stream": True, "messages": MESSAGES}
    raw = json.dumps(body).encode()
    asked, relay = relay_stream(raw, body, timings=False)
    assert json.loads(asked) == {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert asked.endswith(raw[1:])  # the client's bytes kept as they were
    assert relay.strip is not None and not relay.timings and relay.choices == 1
    other = {**body, "stream_options": {"continuous_usage_stats": False}, "n": 2}
    asked, relay = relay_stream(json.dumps(other).encode(), other, timings=False)
    assert json.loads(asked)["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert relay.choices == 2
    wanted = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert relay_stream(json.dumps(wanted).encode(), wanted, timings=False) == (json.dumps(wanted).encode(),
                                                                              Relay(None))
    # llama.cpp: its timings in every event, not a usage event (which would take them from the last).
    asked, relay = relay_stream(raw, body, timings=True)
    assert json.loads(asked) == {**body, "timings_per_token": True} and asked.endswith(raw[1:])
    assert relay.timings and relay.strip is not None
    mine = {**body, "timings_per_token": True}
    assert relay_stream(json.dumps(mine).encode(), mine, timings=True)[1] == Relay(None, True)


def _vllm_event(i: int, content: str | None, done: int, finish: str | None = None) -> bytes:
    """An event as vLLM writes it asked for running counts (continuous_usage_stats)."""
    delta = {"content": content} if content is not None else {}
    return b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                   "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}],
                                   "usage": {"prompt_tokens": 9, "total_tokens": 9 + done, "completion_tokens": done,
                                             "completion_tokens_details": {"reasoning_tokens": 0}}},
                                  separators=(",", ":")).encode() + b"\n\n"


def test_what_the_client_did_not_ask_for_is_taken_out_and_the_running_count_read() -> None:
    final = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
             b'"usage":{"prompt_tokens":9,"total_tokens":14,"completion_tokens":5}}\n\n')
    stream = (_vllm_event(0, "a b", 2) + _vllm_event(0, ' c \\"usage\\":{', 5) + _vllm_event(0, None, 5, "stop")
              + final + b"data: [DONE]\n\n")
    running = re.compile(rb',"usage":\{[^{}]*\{[^{}]*\}\}')
    plain = running.sub(b"", stream)
    assert plain.count(b'"usage"') == 1 and plain.endswith(final + b"data: [DONE]\n\n")
    body = {"model": "m", "stream": True, "messages": MESSAGES}
    nothing = relay_stream(json.dumps(body).encode(), body, timings=False)[1]
    assert nothing.strip is not None and nothing.strip(stream) == plain.replace(final, b"")
    events = {**body, "stream_options": {"include_usage": True}}
    just_events = relay_stream(json.dumps(events).encode(), events, timings=False)[1]
    assert just_events.strip is not None and just_events.strip(stream) == plain
    # Wherever the count is in its event, and however the JSON is spaced, the event stays JSON.
    first = (b'data: {"usage": {"prompt_tokens": 9, "completion_tokens": 1}, '
             b'"choices": [{"delta": {"content": "a"}}]}\n\n')
    assert nothing.strip(first) == b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
    # What the client was handed, as the engine counted it: the last whole count written.
    meter = Meter(nothing)
    assert meter.count() is None
    meter.written(_vllm_event(0, "a b", 2))
    meter.written(_vllm_event(0, " c", 5)[:-40])  # a piece that ends inside its count
    assert meter.count() == (9, 2)
    meter.written(_vllm_event(0, " d", 7))
    assert meter.count() == (9, 7)
    # Several answers: each event counts its own answer.
    several = Meter(Relay(None, choices=2))
    for piece in (_vllm_event(0, "a", 1) + _vllm_event(1, "b c", 2), _vllm_event(0, " d e f", 4)):
        several.written(piece)
    assert several.count() == (9, 6)


def test_llama_cpps_timings_are_taken_out_of_every_event_but_its_last() -> None:
    def event(content: str | None, n: int, finish: str | None = None) -> bytes:
        delta = {"content": content} if content is not None else {}
        return b"data: " + json.dumps({  # llama.cpp's keys come sorted
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "created": 1, "id": "c", "model": "m",
            "system_fingerprint": "b1", "object": "chat.completion.chunk",
            "timings": {"cache_n": 3, "prompt_n": 30, "prompt_ms": 1.5, "predicted_n": n, "predicted_ms": 2.0}},
            separators=(",", ":")).encode() + b"\n\n"

    stream = event("Hel", 1) + event("lo wor", 3) + event(None, 4, "stop") + b"data: [DONE]\n\n"
    body = {"model": "m", "stream": True, "messages": MESSAGES}
    relay = relay_stream(json.dumps(body).encode(), body, timings=True)[1]
    assert relay.strip is not None
    out = relay.strip(stream)
    assert out.count(b'"timings"') == 1 and out.split(b"\n\n")[2] == event(None, 4, "stop")[:-2]
    assert [json.loads(e[6:]) for e in out.split(b"\n\n")[:2]] == [
        {k: v for k, v in json.loads(e[6:]).items() if k != "timings"} for e in stream.split(b"\n\n")[:2]]
    meter = Meter(relay)
    meter.written(event("Hel", 1) + event("lo wor", 3))
    assert meter.count() == (33, 3)


def test_a_piece_is_whole_up_to_its_last_blank_line() -> None:
    assert whole_events(b"data: 1\n\ndata: 2\n\n") == len(b"data: 1\n\ndata: 2\n\n")
    assert whole_events(b"data: 1\n\ndata: 2") == len(b"data: 1\n\n")
    assert whole_events(b"data: 1\r\n\r\ndata: 2") == len(b"data: 1\r\n\r\n")
    assert whole_events(b"data: 1\n") == whole_events(b"data: 1") == 0


def test_the_usage_event_is_taken_out_when_whole() -> None:
    chunk = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
             b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    assert strip_usage_events(chunk) == (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
                                         b"data: [DONE]\n\n")
    assert reported_usage(chunk) == (5, 2)
    crlf = chunk.replace(b"\n\n", b"\r\n\r\n")  # SSE's other blank line
    assert strip_usage_events(crlf) == strip_usage_events(chunk).replace(b"\n\n", b"\r\n\r\n")
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
        assert all(ch.usage is None for ch in asked[:-1])  # no running counts: it asked for none
        # Usage per key is served behind the admin token only (Router.metrics_app, test_metrics_surface).
        metrics = generate_latest(router.metrics.tenants).decode()
    assert whole.usage is not None
    prompt = whole.usage.prompt_tokens
    assert asked[-1].usage.prompt_tokens == prompt and asked[-1].usage.completion_tokens == 4
    u = ledger_usage(router)[("", "chat")]
    assert (u.requests, u.errors, u.counted_from_stream) == (3, 0, 0)
    assert u.prompt_tokens == 3 * prompt
    assert u.completion_tokens == whole.usage.completion_tokens + 5 + 4 == 16
    samples = {(s.labels["model"], s.labels["kind"]): s.value for f in text_string_to_metric_families(metrics)
               for s in f.samples if s.name == "llmgw_router_usage_tokens_total"}
    assert samples[("chat", "prompt")] == 3 * prompt and samples[("chat", "completion")] == 16


async def test_a_stream_the_client_leaves_is_charged_what_the_client_received(chat_sim: SimProcess,
                                                                              stream_sim: SimProcess) -> None:
    """The client stops listening after three events with content (1 to 3 tokens each): it is
    charged the tokens it was handed, counted here as the simulator's words (one token each), and
    the prompt the engine read; the engine wrote at least that much, far fewer than the 200 asked."""
    router = make(chat_sim, stream_sim)
    prompt = sim_metric(stream_sim.endpoint, "vllm:prompt_tokens_total")
    written = sim_metric(stream_sim.endpoint, "vllm:generation_tokens_total")
    cancelled = sim_metric(stream_sim.endpoint, "llmgw_sim_requests_cancelled_total")
    async with serving(router) as base:
        body = {"model": "stream", "messages": MESSAGES, "max_tokens": 200, "stream": True}
        got = await asyncio.to_thread(stream_raw, base + "/v1/chat/completions", body, leave_after=3)
        for _ in range(600):
            if ("", "stream") in ledger_usage(router):
                break
            await asyncio.sleep(0.05)
    for _ in range(600):  # until the engine saw its request end: its counters are final then
        if sim_metric(stream_sim.endpoint, "llmgw_sim_requests_cancelled_total") > cancelled:
            break
        await asyncio.sleep(0.05)
    received = len(got.content().split())
    assert got.status == 200 and not got.done and got.content_events() >= 3
    assert all("usage" not in e for e in got.events)  # the running counts the router asked for are gone
    u = ledger_usage(router)[("", "stream")]
    # Counted from the engine's own running count, not from the stream's events.
    assert (u.requests, u.errors, u.counted_from_stream) == (1, 1, 0)
    assert u.completion_tokens == received
    assert u.prompt_tokens == sim_metric(stream_sim.endpoint, "vllm:prompt_tokens_total") - prompt > 0
    assert received <= sim_metric(stream_sim.endpoint, "vllm:generation_tokens_total") - written < 200


async def test_a_stream_whose_engine_dies_is_charged_what_the_client_received() -> None:
    """The engine is killed (SIGKILL) once the client has three events with content: the client
    gets what the router had relayed and an error event, and is charged those tokens (counted
    here as the simulator's words) and the prompt the engine had read before it died."""
    with SimProcess("doomed", "--tokens-per-second", "20") as sim:
        router = Router(config=RouterConfig())
        router.set_catalog(Catalog(models=(model("doomed"),)))
        router.set_endpoints([endpoint("doomed", sim.endpoint)])
        prompt: list[float] = []

        def kill() -> None:
            prompt.append(sim_metric(sim.endpoint, "vllm:prompt_tokens_total"))
            os.kill(sim.pid, signal.SIGKILL)

        async with serving(router) as base:
            body = {"model": "doomed", "messages": MESSAGES, "max_tokens": 500, "stream": True}
            got = await asyncio.to_thread(stream_raw, base + "/v1/chat/completions", body, call_after=(3, kill))
            for _ in range(600):
                if ("", "doomed") in ledger_usage(router):
                    break
                await asyncio.sleep(0.05)
    assert got.status == 200 and not got.done and "error" in got.events[-1]
    assert got.content_events() >= 3 and all("usage" not in e for e in got.events)
    u = ledger_usage(router)[("", "doomed")]
    assert (u.requests, u.errors, u.counted_from_stream) == (1, 1, 0)
    assert (u.prompt_tokens, u.completion_tokens) == (prompt[0], len(got.content().split()))


async def test_counts_split_over_reads_are_taken_out_whole_and_an_unfinished_event_is_not_passed_on() -> None:
    """Each event reaches the router in two reads, split inside its running count, and the engine
    dies half-way through the fourth: the client gets three whole events without the counts it
    did not ask for, then the error event, and is charged the count of the third."""
    events = [_vllm_event(0, "a b", 2), _vllm_event(0, " c", 3), _vllm_event(0, " d e f", 6), _vllm_event(0, " g", 7)]

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i, e in enumerate(events):
            cut = e.index(b'"completion_tokens"') + 5
            for part in (e[:cut], e[cut:]) if i < 3 else (e[:cut],):
                w.write(b"%x\r\n%s\r\n" % (len(part), part))
                await w.drain()
                await asyncio.sleep(0.05)  # its own read, as a rule (nothing asserted hangs on it)
        w.close()

    async with engine(answer) as (url, seen):
        router = Router(config=RouterConfig())
        router.set_catalog(Catalog(models=(model("chat"),)))
        router.set_endpoints([endpoint("chat", url)])
        async with serving(router) as base:
            body = {"model": "chat", "messages": MESSAGES, "stream": True}
            got = await asyncio.to_thread(stream_raw, base + "/v1/chat/completions", body)
    assert json.loads(seen[0].split(b"\r\n\r\n", 1)[1])["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": True}
    plain = [{k: v for k, v in json.loads(e[6:]).items() if k != "usage"} for e in events[:3]]
    assert got.events[:3] == plain and "error" in got.events[3] and len(got.events) == 4
    u = ledger_usage(router)[("", "chat")]
    assert (u.requests, u.errors, u.counted_from_stream, u.prompt_tokens, u.completion_tokens) == (1, 1, 0, 9, 6)


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
    u = ledger_usage(router)[("", "chat")]
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
    usage = ledger_usage(router)
    assert usage[("team-a", "chat")].requests == 2 and usage[("team-a", "chat")].completion_tokens == 6
    assert usage[("team-b", "chat")].requests == 1 and usage[("team-b", "chat")].completion_tokens == 9


def test_only_whole_usage_events_are_stripped_whatever_the_read_boundaries() -> None:
    stream = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
              b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
              b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
              b"data: [DONE]\n\n")
    want = stream.replace(b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n', b"")
    # A boundary inside the usage event's "choices":[] hides from both pieces that it is the usage
    # event: its count is taken out as an event's running count.
    countless = stream.replace(b',"usage":{"prompt_tokens":5,"completion_tokens":2}', b"")
    for cut in range(1, len(stream)):
        out = strip_usage_events(stream[:cut]) + strip_usage_events(stream[cut:])
        events = [e for e in out.split(b"\n\n") if e]
        # Every event the client gets is whole JSON (or [DONE]); the usage event is gone unless a
        # read boundary split it, in which case it is passed on whole or without its count.
        assert out in (want, stream, countless), cut
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
