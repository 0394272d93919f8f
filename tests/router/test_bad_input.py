"""Bad input to the router is a 4xx in the OpenAI error format that names what is wrong."""

from __future__ import annotations

import aiohttp
import pytest

from llmgw.engines.testing import SimProcess
from tests.router.conftest import serving
from tests.router.test_serving import make_router


async def post(base: str, path: str, data: bytes, method: str = "POST") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.request(method, base + path, data=data,
                                                       headers={"Content-Type": "application/json"}) as r:
        assert r.content_type == "application/json", await r.text()
        return r.status, await r.json()


@pytest.mark.parametrize(("data", "code", "words"), [
    (b'{"model": "chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json", "nested"),
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
