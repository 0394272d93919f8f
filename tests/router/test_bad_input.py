"""Bad input to the router is a 4xx in the OpenAI error format that names what is wrong."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time

import aiohttp
import pytest

import llmgw.serving as serving_module
from llmgw.engines.testing import SimProcess
from tests.router.conftest import endpoint, router_metric, serving, sim_metric
from tests.router.test_serving import make_router


async def post(base: str, path: str, data: bytes, method: str = "POST") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.request(method, base + path, data=data,
                                                       headers={"Content-Type": "application/json"}) as r:
        assert r.content_type == "application/json", await r.text()
        return r.status, await r.json()


@pytest.mark.parametrize(("data", "code", "words"), [
    (b'{"model": "chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json",
     "more than 64 levels deep (the limit)"),
    (b'{"model": "chat", "stream": "no", "messages": [{"role": "user", "content": "hi"}]}', "invalid_stream",
     "`stream` must be true or false"),
    (b'{"model": "chat", "stream": 1, "messages": []}', "invalid_stream", "true or false"),
    (b'[1, 2]', "invalid_json", "JSON object"),
    (b'{"model": 7}', "missing_model", "`model`"),
])
async def test_bad_bodies_are_400_with_a_reason(chat_sim: SimProcess, data: bytes, code: str, words: str) -> None:
    async with serving(make_router(chat_sim)) as base:
        status, body = await post(base, "/v1/chat/completions", data)
    assert status == 400 and body["error"]["code"] == code and words in body["error"]["message"], body


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# Bigger than any body parsed on the event loop: these go to the parse worker (llmgw.router.parse).
PAD = b'"pad": "' + b"x" * 300_000 + b'", '


def deep_bodies(depth: int) -> list[tuple[str, str, bytes]]:
    """(path, where the nesting sits, body) for every endpoint, streamed or not, small and big."""
    d = nested(depth)
    hi = b'[{"role": "user", "content": "hi"}]'
    shapes = [
        (CHAT, "a member of its own", b'{"model": "chat", %s"messages": ' + hi + b', "x": ' + d + b"}"),
        (CHAT, "a message's content", b'{"model": "chat", %s"messages": [{"role": "user", "content": ' + d + b"}]}"),
        (CHAT, "stream_options", b'{"model": "chat", %s"stream_options": {"x": ' + d + b'}, "messages": ' + hi + b"}"),
        (CHAT, "tools", b'{"model": "chat", %s"tools": ' + d + b', "messages": ' + hi + b"}"),
        (COMPLETIONS, "the prompt", b'{"model": "chat", %s"prompt": ' + d + b"}"),
        (EMBEDDINGS, "the input", b'{"model": "embed", %s"input": ' + d + b"}"),
    ]
    out = []
    for path, where, shape in shapes:
        for stream in (b"", b'"stream": true, '):
            for pad in (b"", PAD):
                out.append((path, f"{where}{', streamed' if stream else ''}{', big' if pad else ''}",
                            shape % (stream + pad)))
    return out


CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


@pytest.mark.parametrize("depth", [100, 976, 100_000])
async def test_deep_json_is_a_400_naming_the_limit_on_every_endpoint(chat_sim: SimProcess, embed_sim: SimProcess,
                                                                     depth: int) -> None:
    """A 976-deep body passed the parse, reached the engine and came back a 500 with a traceback."""
    before = sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total")
    router = make_router(chat_sim, endpoint("embed", embed_sim.endpoint, task="embedding"))
    async with serving(router) as base:
        for path, where, data in deep_bodies(depth):
            status, body = await post(base, path, data)
            assert status == 400, (path, where, status, body)
            assert body["error"]["code"] == "invalid_json", (path, where, body)
            assert "more than 64 levels deep (the limit)" in body["error"]["message"], (path, where, body)
    assert sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total") == before  # the engine saw none of them


async def test_json_as_deep_as_the_limit_is_served(chat_sim: SimProcess) -> None:
    async with serving(make_router(chat_sim)) as base:
        for pad in (b"", PAD):  # on the event loop, and in the parse worker
            data = b'{"model": "chat", ' + pad + b'"messages": [{"role": "user", "content": "hi"}], "x": ' \
                + nested(63) + b"}"  # 64 levels with the body itself
            status, body = await post(base, CHAT, data)
            assert status == 200 and body["choices"][0]["message"]["content"], body


async def test_unknown_paths_and_wrong_methods_answer_in_the_openai_format(chat_sim: SimProcess) -> None:
    async with serving(make_router(chat_sim)) as base:
        status, body = await post(base, "/v1/nope", b"{}")
        assert status == 404 and body["error"]["code"] == "unknown_url" and "/v1/nope" in body["error"]["message"]
        async with aiohttp.ClientSession() as s, s.get(base + "/v1/chat/completions") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert (await r.json())["error"]["code"] == "method_not_allowed"
        # The real routes still work behind the catch-all.
        ok = b'{"model": "chat", "stream": false, "messages": [{"role": "user", "content": "hi"}]}'
        status, body = await post(base, "/v1/chat/completions", ok)
        assert status == 200 and body["choices"][0]["message"]["content"]


async def raw_exchange(base: str, data: bytes, *, wait: float = 5.0) -> bytes:
    """``data`` sent on a fresh socket; everything the router answered before closing it."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(wait):
            return await reader.read()
    finally:
        writer.close()


@pytest.mark.parametrize(("data", "status"), [
    (b"GARBAGE\x00\x01 / HTTP/1.1\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
])
async def test_what_the_http_parser_rejects_is_answered_in_the_openai_format(
        chat_sim: SimProcess, data: bytes, status: int, caplog: pytest.LogCaptureFixture) -> None:
    async with serving(make_router(chat_sim)) as base:
        answer = await raw_exchange(base, data)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.") and head[9:12] == b"%d" % status, answer[:200]
        assert b"application/json" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "bad_http" and error["message"].startswith("The request is not valid HTTP/1.1")
        # The router still serves after it.
        ok = b'{"model": "chat", "stream": false, "messages": [{"role": "user", "content": "hi"}]}'
        assert (await post(base, "/v1/chat/completions", ok))[0] == 200
    assert "Traceback" not in caplog.text


async def test_junk_in_a_loop_is_logged_once_not_per_request(chat_sim: SimProcess,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    junk = b"\x16\x03\x01 TLS hello to a plain port\r\n\r\n"
    async with serving(make_router(chat_sim)) as base:
        await raw_exchange(base, junk)  # another server in this process said it first
    caplog.clear()
    async with serving(make_router(chat_sim)) as base:
        for _ in range(50):
            await raw_exchange(base, junk)
    # Each server's own log limit (it was one per process, which tests had to reset).
    lines = [r for r in caplog.records if "not valid HTTP" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]


@pytest.mark.timeout(20)
async def test_a_client_trickling_its_head_is_cut_off(chat_sim: SimProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving_module, "KEEPALIVE_TIMEOUT", 1.0)
    async with serving(make_router(chat_sim)) as base:
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        t0 = time.monotonic()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        closed_after = None
        for byte in head:  # one byte every 0.1 s: 20 s for the whole head if nobody cut it
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                closed_after = time.monotonic() - t0
                break
            if reader.at_eof() or (await _readable(reader)):
                closed_after = time.monotonic() - t0
                break
            await asyncio.sleep(0.1)
        writer.close()
    assert closed_after is not None and closed_after < 5, closed_after


async def _readable(reader: asyncio.StreamReader) -> bool:
    try:
        async with asyncio.timeout(0.01):
            await reader.read(1)
        return True  # EOF (b"") or bytes: either way the router is done with this connection
    except ConnectionError:
        return True  # reset: the router closed while our last byte was on its way
    except TimeoutError:
        return False


async def test_a_body_that_does_not_arrive_in_time_is_408(chat_sim: SimProcess) -> None:
    router = make_router(chat_sim, body_timeout=1.0)
    async with serving(router) as base:
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        await writer.drain()
        async with asyncio.timeout(30):  # answered after the 1 s body timeout, not left hanging
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert router_metric(router, "llmgw_router_request_body_bytes") == 0


@pytest.mark.parametrize("data", [gzip.compress(b'{"model": "chat", "messages": []}', mtime=0), b"not gzip at all"],
                         ids=["gzip", "not-gzip"])  # mtime=0, ids: xdist's workers must collect the same tests
async def test_a_compressed_body_is_a_415_before_it_is_read(chat_sim: SimProcess, data: bytes) -> None:
    """aiohttp decompresses request bodies and the size limits applied to what came out (352 KB of
    gzip sent, 344 MB held); one that did not decompress was a 500 with a traceback. No OpenAI
    client compresses a body, nor does any engine take one: refused, saying why."""
    router = make_router(chat_sim)
    async with serving(router) as base, aiohttp.ClientSession() as s, s.post(
            base + "/v1/chat/completions", data=data,
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as r:
        status, answer = r.status, await r.json()
    assert status == 415, answer
    assert answer["error"]["code"] == "unsupported_content_encoding"
    assert "Content-Encoding `gzip` are not accepted here; send the body uncompressed" in answer["error"]["message"]
    assert router_metric(router, "llmgw_router_request_body_bytes") == 0
