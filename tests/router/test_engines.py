"""What the router does differently per engine (llmgw.router.engines), through the real Router.

llama.cpp reports its exact counts in every answer's ``timings`` unasked, and asked for a
stream's usage event it moves them there, where a client that did not ask would lose them: so
a stream to llama.cpp is not asked for usage, and its usage and prompt-cache hits are read from
the timings. Every other engine is asked for the usage event, which is taken out again before
the client sees it. The engine here is a real HTTP server that answers as each engine does and
records what it was sent.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
from aiohttp import web

from llmgw.catalog.model import Catalog
from llmgw.contract import PromptCache
from llmgw.router import Router
from llmgw.router.engines import engine_profile
from llmgw.router.table import Upstream
from tests.router.conftest import client, endpoint, serving, serving_app
from tests.router.fake_controller import model

HELLO = [{"role": "user", "content": "Hello"}]


def _event(d: dict) -> bytes:
    return b"data: " + json.dumps(d).encode() + b"\n\n"


def _chunk(content: str, finish: str | None = None, **extra: object) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}], **extra}


@asynccontextmanager
async def recording_engine(sent: list[dict]) -> AsyncIterator[str]:
    """Streams "Hello": with a usage event (7 prompt, 2 completion tokens) when asked for one, as
    vLLM does, else with llama.cpp's timings (5 prompt tokens, 3 of them from its cache, 2 predicted)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sent.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_event(_chunk("Hel")))
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(_event(_chunk("lo", "stop")))
            await resp.write(_event({"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                     "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                                              "total_tokens": 9}}))
        else:
            await resp.write(_event(_chunk("lo", "stop", timings={"cache_n": 3, "prompt_n": 2, "predicted_n": 2})))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving_app(app) as url:
        yield url


@pytest.mark.parametrize(("engine", "reuse", "ask"), [
    ("llama.cpp", False, False), ("vllm", True, True), ("sglang", True, True), ("sim", True, True)])
def test_a_replica_takes_its_engines_profile_when_it_joins_the_table(engine: str, reuse: bool, ask: bool) -> None:
    up = Upstream(replace(endpoint("m", "http://127.0.0.1:1"), engine=engine))
    assert up.engine == engine_profile(engine)
    # llama-server drops idle keep-alive connections while busy: a request sent on one is lost.
    assert up.origin.reuse is reuse
    assert up.engine.ask_usage is ask


async def test_llama_cpp_is_not_asked_for_usage_and_its_timings_are_counted() -> None:
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
                              [c.usage for c in chunks if c.usage is not None])
    assert [("stream_options" in b) for b in sent] == [False, True]
    assert sent[1]["stream_options"] == {"include_usage": True}
    # The client asked for no usage, and got none, from either engine; the answer is whole.
    assert seen == {"l": ("Hello", []), "v": ("Hello", [])}
    usage = router.usage()
    assert (usage[("", "l")].prompt_tokens, usage[("", "l")].completion_tokens) == (5, 2)
    assert (usage[("", "v")].prompt_tokens, usage[("", "v")].completion_tokens) == (7, 2)
    assert usage[("", "l")].counted_from_stream == usage[("", "v")].counted_from_stream == 0
    # Prompt-cache hits from llama.cpp's timings; an engine without them adds none per answer.
    cache = router.prompt_cache()
    assert cache["l"] == PromptCache(prompt_tokens=5, cached_tokens=3)
    assert "v" not in cache
