"""What the router counts as a replica's error (issue 26): the figures a canary is judged by.

Engines fail in ways a TCP-level check does not see, and each must count against the replica
that failed, or a broken canary passes its analysis and is promoted to the whole fleet:

- vLLM's OpenAI server catches an exception during a streamed generation and sends
  ``data: {"error": {...}}`` followed by ``data: [DONE]`` on a 200 stream
  (vllm/entrypoints/openai/serving_chat.py, chat_completion_stream_generator: ``except Exception
  as e: data = self.create_streaming_error_response(...); yield f"data: {data}\\n\\n"`` then
  ``yield "data: [DONE]\\n\\n"``); the openai SDK raises ``APIError`` on it.
- An engine (or a proxy in front of it) that ends the body cleanly before ``data: [DONE]``: the
  answer is cut, though nothing failed at the TCP level.
- An engine that refuses with 429 (a queue or KV budget set too small: TGI's "Model is
  overloaded"). A 429 the router itself makes (a tenant's limit) never reached a replica and is
  not counted at all.

The engines here are real HTTP servers (aiohttp) failing the way real engines do (the simulator
has no such modes), behind the real Router, with the real openai client as the user. And the
other side: whole answers of the real simulator and of a real llama.cpp server are not errors.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import openai
import pytest
from aiohttp import web

from llmgw.catalog import CanaryChecks
from llmgw.catalog.model import Catalog, Limits, Settings, Tenant
from llmgw.contract import Endpoint
from llmgw.decide.rollout import judge
from llmgw.engines.testing import LlamaServers, SimProcess
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from llmgw.router.proxy import _ends_stream
from tests.e2e.test_llamacpp_fleet import BINARY, GGUF, requires_engine
from tests.router.conftest import client, endpoint, serving, serving_app
from tests.router.fake_controller import model

HELLO = [{"role": "user", "content": "Hello"}]
DONE = b"data: [DONE]\n\n"


def _chunk(content: str, finish: str | None = None) -> bytes:
    d = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": content}, "finish_reason": finish}]}
    return b"data: " + json.dumps(d).encode() + b"\n\n"


# How each engine's stream goes on after its first chunk ("Hel"): the parts it writes, one write each.
STREAMS: dict[str, list[bytes]] = {
    # vLLM's error event (its ErrorResponse as serving_engine.create_streaming_error_response dumps it)
    "vllm-error-event": [b"data: " + json.dumps({"error": {
        "object": "error", "message": "CUDA error: an illegal memory access was encountered",
        "type": "InternalServerError", "param": None, "code": 500}}).encode() + b"\n\n", DONE],
    # TGI writes the error as a string; the openai SDK raises on any truthy "error" all the same
    "string-error-event": [b'data:{"error":"Request failed during generation: overloaded","error_type":"generation"}'
                           b"\n\n", DONE],
    "clean-cut": [],  # the body ends here: no finish_reason, no [DONE]
    # Whole answers, however their end is written or split:
    "whole": [_chunk("lo", "stop"), DONE],
    "split-marker": [_chunk("lo", "stop"), b"data: [DO", b"NE]\n\n"],
    "marker-without-space": [_chunk("lo", "stop"), b"data:[DONE]\n\n"],
    "crlf": [_chunk("lo", "stop").replace(b"\n\n", b"\r\n\r\n"), b"data: [DONE]\r\n\r\n"],
    # The model wrote the word and a JSON error object as text: escaped inside its content.
    "says-error": [_chunk("error"), _chunk('{"error": {"message": "x"}}'), _chunk("", "stop"), DONE],
}
FAILING = ("vllm-error-event", "string-error-event", "clean-cut")
WHOLE = ("whole", "split-marker", "marker-without-space", "crlf", "says-error")


@asynccontextmanager
async def engine(mode: str) -> AsyncIterator[str]:
    """A real HTTP engine whose streams go on after the first token as ``STREAMS[mode]`` says."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": "hi"}}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk("Hel"))
        for part in STREAMS[mode]:
            await resp.write(part)
            await asyncio.sleep(0.005)  # its own read at the router, most of the time (either way is valid)
        await resp.write_eof()
        return resp

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    async with serving_app(app) as url:
        yield url


async def _run(mode: str, n: int = 10) -> tuple[int, int, int, int]:
    """n streamed requests through the router: (client-visible failures or truncations, and the
    replica's requests, errors and answers with a time to first token) as the router measured them."""
    async with engine(mode) as url:
        router = Router()
        router.set_catalog(Catalog(models=(model("m"),)))
        router.set_endpoints([endpoint("m", url, "canary")])
        async with serving(router) as base, client(base) as cl:
            bad = 0
            for _ in range(n):
                text, finish = "", None
                try:
                    stream = await cl.chat.completions.create(model="m", messages=HELLO, stream=True, max_tokens=6)
                    async for c in stream:
                        if c.choices:
                            text += c.choices[0].delta.content or ""
                            finish = c.choices[0].finish_reason or finish
                except openai.APIError:
                    bad += 1
                    continue
                if finish is None:  # no finish_reason: the answer was cut short
                    bad += 1
            while router.requests_in_flight():  # the last attempt is recorded once the client has it all
                await asyncio.sleep(0.01)
            s = router.usage.replica_stats()[router.usage.instance_id]["canary"]
            return bad, s.requests, s.errors, sum(s.ttft)


async def test_a_vllm_error_event_mid_stream_counts_as_the_replicas_error() -> None:
    """Every streamed request fails for the user (the openai client raises on the error event):
    the replica's figures must say so, and give no 'fast' time to first token for them."""
    bad, requests, errors, timed = await _run("vllm-error-event")
    assert bad == 10  # the user saw every one fail
    assert (requests, errors) == (10, 10), f"router counted {errors} errors of {requests} requests"
    assert timed == 0  # failures carry no latency: a broken version cannot look fast


async def test_an_error_event_whose_error_is_a_string_counts_as_well() -> None:
    bad, requests, errors, _ = await _run("string-error-event")
    assert bad == 10
    assert (requests, errors) == (10, 10), f"router counted {errors} errors of {requests} requests"


async def test_a_stream_the_engine_ends_without_its_end_marker_counts_as_an_error() -> None:
    """The engine ends the body cleanly after the first chunk (no [DONE], no finish_reason): a
    clean EOF is not a whole answer. The client is told (an error event, as for a stream that
    breaks), instead of a silent truncation."""
    bad, requests, errors, timed = await _run("clean-cut")
    assert bad == 10  # every answer truncated
    assert (requests, errors) == (10, 10), f"router counted {errors} errors of {requests} requests"
    assert timed == 0


@pytest.mark.parametrize("mode", WHOLE)
async def test_whole_streams_are_not_errors_however_their_end_is_written(mode: str) -> None:
    """The other side of the two above: the end marker split over two reads, written without the
    space or with CRLF, and a model that writes the word "error" (or a JSON error object) in its
    answer are whole answers, counted with their latency."""
    bad, requests, errors, timed = await _run(mode)
    assert (bad, requests, errors, timed) == (0, 10, 0, 10)


def test_the_end_marker_is_found_wherever_the_engine_split_it() -> None:
    body = _chunk("lo", "stop") + DONE
    for cut in range(1, len(body)):  # every way the last event and the marker fall over two reads
        head, last = body[:cut], body[cut:]
        assert _ends_stream(last, head) or _ends_stream(head, b""), cut
    assert _ends_stream(DONE, b"")  # a stream with no content at all
    assert not _ends_stream(_chunk("data: [DONE]"), b"")  # the model's text: escaped, inside a string
    assert not _ends_stream(b'data: {"x": "a\\ndata: [DONE]"}\n\n', b"")
    assert not _ends_stream(_chunk("lo"), b"")


@asynccontextmanager
async def refusing_engine() -> AsyncIterator[str]:
    async def refuse(_request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Model is overloaded", "type": "overloaded"}}, status=429)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    async with serving_app(app) as url:
        yield url


@pytest.mark.slow
async def test_a_canary_that_answers_429_to_every_request_fails_its_analysis() -> None:
    """A new version whose args make it refuse everything with 429 (a queue or KV budget set too
    small). The router passes the 429 on (no retry); counted as the replica's error, so judge()
    fails it against the stable group (an overloaded fleet would fail both alike)."""
    async with refusing_engine() as url:
        with SimProcess("m") as stable:
            router = Router()
            router.set_catalog(Catalog(models=(model("m"),)))
            router.set_endpoints([replace(endpoint("m", stable.endpoint, "stable"), canary_percent=50.0),
                                  replace(endpoint("m", url, "canary"), canary=True, canary_percent=50.0)])
            async with serving(router) as base, client(base) as cl:
                refused = 0
                for i in range(60):
                    try:  # 60 conversations: the canary's share is a share of conversations
                        await cl.chat.completions.create(model="m", max_tokens=4, messages=[
                            {"role": "user", "content": f"Hello from conversation {i}"}])
                    except openai.RateLimitError:
                        refused += 1
                mine = router.usage.replica_stats()[router.usage.instance_id]
    assert refused == mine["canary"].requests > 0  # every canary request refused to the user
    assert mine["canary"].errors == refused and sum(mine["canary"].ttft) == 0
    assert (mine["stable"].requests, mine["stable"].errors) == (60 - refused, 0)
    a = judge(CanaryChecks(min_requests=5), mine["canary"], mine["stable"], seconds=60, now=0)
    assert a.verdict == "fail", f"{refused} of 60 clients refused by the canary; analysis: {a.verdict}: {a.reason}"


async def test_a_429_the_router_makes_for_a_tenant_is_no_replicas_doing() -> None:
    """A tenant over its limit is refused by the router before any replica is chosen: neither an
    error nor a request of the replica (a canary must not fail because a tenant is busy)."""
    async with engine("whole") as url:
        keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
        router = Router(keys=keys, config=RouterConfig(), wall=lambda: 1_800_000_000.0)  # a clock standing still
        router.set_catalog(Catalog(models=(model("m"),), settings=Settings(tenants=(
            Tenant("team", ("team-key",), Limits(requests_per_minute=2)),))))
        router.set_endpoints([endpoint("m", url, "r")])
        async with serving(router) as base, client(base, "sk-team") as cl:
            answered = refused = 0
            for _ in range(5):
                try:
                    await cl.chat.completions.create(model="m", messages=HELLO, max_tokens=4)
                    answered += 1
                except openai.RateLimitError:
                    refused += 1
            mine = router.usage.replica_stats()[router.usage.instance_id]["r"]
    assert (answered, refused) == (2, 3)
    assert (mine.requests, mine.errors) == (2, 0)


@pytest.mark.slow
@requires_engine
async def test_a_real_llama_cpp_servers_streams_are_whole(tmp_path: Path) -> None:
    """llama.cpp's server ends its OpenAI streams with ``data: [DONE]`` (chat and completions, with
    and without a usage event): none of its answers may count as cut."""
    assert BINARY is not None and GGUF is not None
    servers = LlamaServers(BINARY, GGUF, tmp_path, count=1, extra=("--ctx-size", "512"))
    try:
        router = Router()
        router.set_catalog(Catalog(models=(model("smol"),)))
        router.set_endpoints([Endpoint(replica_id="r", model="smol", names=("smol",), url=servers.urls[0],
                                       engine="llama.cpp", profile="cpu", priority=0)])
        async with serving(router) as base, openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                                                timeout=120) as cl:
            finishes = []
            for usage in (False, True):
                options = {"stream_options": {"include_usage": True}} if usage else {}
                chat = await cl.chat.completions.create(model="smol", messages=HELLO, stream=True, max_tokens=4,
                                                        **options)  # type: ignore[call-overload]
                finishes += [c.choices[0].finish_reason async for c in chat if c.choices and c.choices[0].finish_reason]
                text = await cl.completions.create(model="smol", prompt="Hello", stream=True, max_tokens=4,
                                                   **options)  # type: ignore[call-overload]
                finishes += [c.choices[0].finish_reason async for c in text if c.choices and c.choices[0].finish_reason]
            while router.requests_in_flight():
                await asyncio.sleep(0.01)
            mine = router.usage.replica_stats()[router.usage.instance_id]["r"]
    finally:
        servers.close()
    assert len(finishes) == 4  # each answer ended as the engine says
    assert (mine.requests, mine.errors, sum(mine.ttft)) == (4, 0, 4)
