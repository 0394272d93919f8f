"""Big request bodies are parsed off the event loop (issue 24): a real router, real HTTP, a real
parse worker process; engines are raw sockets that record what they got, or the simulator.

What a user would check: a big body reaches the engine whole (with only the router's own changes),
a small request is answered while big ones wait for the parser, a parser that is busy or dies is
a 503 worth retrying, and a big body is admitted exactly as a small one would be."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from llmgw.catalog.model import Budget, Catalog, Limits, Settings, Tenant
from llmgw.engines.testing import SimProcess
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from tests.router.conftest import endpoint, router_metric, serving
from tests.router.fake_controller import model
from tests.router.test_deliveries import engine, write_completion
from tests.router.test_serving import make_router

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
KEYS = [{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}]


def big_messages(n: int = 600) -> list[dict]:
    # ~400 KB: above what is parsed on the event loop (llmgw.router.parse.INLINE_BYTES).
    return [{"role": "user", "content": f"é ☃ \U0001F600 \"{i}\" \\ \n" * 30} for i in range(n)]


def pathological(model: str = "chat") -> bytes:
    """~8 MB of tiny messages: the shape that costs a JSON parser the most per byte."""
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}] * 300_000}).encode()


async def post(s: aiohttp.ClientSession, base: str, data: bytes, *, path: str = CHAT,
               key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    timeout = aiohttp.ClientTimeout(total=120)
    async with s.post(base + path, data=io.BytesIO(data), headers=headers, timeout=timeout) as r:
        return r.status, await r.json(content_type=None)


async def metrics(s: aiohttp.ClientSession, base: str) -> dict[tuple[str, tuple], float]:
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for f in text_string_to_metric_families(text) for x in f.samples}


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    """Wait for an event the test can only observe by asking (a hang guard, not a timing claim)."""
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not seen within {timeout} s: {what}") from None


async def parser_holds(s: aiohttp.ClientSession, base: str, parsing: int, waiting: int) -> bool:
    m = await metrics(s, base)
    return (m[("llmgw_router_body_parses", (("state", "parsing"),))],
            m[("llmgw_router_body_parses", (("state", "waiting"),))]) == (parsing, waiting)


def parse_workers() -> list[int]:
    """This process's request body parsers (python -m llmgw.router.parse)."""
    me = str(os.getpid())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == me and b"llmgw.router.parse" in argv:
            found.append(int(proc.name))
    return found


async def answer_whole(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await write_completion(w, 5, 2)


def keyed(url: str, limits: Limits | None = None, **config: object) -> Router:
    router = Router(keys=KeyRing.from_entries(KEYS), config=RouterConfig(**config))  # type: ignore[arg-type]
    tenants = (Tenant("team", ("team-key",), limits),) if limits is not None else ()
    router.set_catalog(Catalog(models=(model("chat", aliases=("gpt-x",)),), settings=Settings(tenants=tenants)))
    router.set_endpoints([endpoint("chat", url, names=("chat", "gpt-x"))])
    return router


def received(seen: list[bytes]) -> dict:
    return json.loads(seen[-1].split(b"\r\n\r\n", 1)[1])


async def test_a_big_body_reaches_the_engine_whole_with_only_the_routers_changes() -> None:
    body = {"model": "gpt-x", "stream": True, "stream_options": {"continuous_usage_stats": False},
            "messages": big_messages(), "temperature": 0.25, "x-vendor": {"a": [1, 2, {"b": None}]},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    raw = json.dumps(body, ensure_ascii=False).encode()
    capped = {**body, "model": "chat", "stream": False, "max_tokens": 10, "max_completion_tokens": 20}
    del capped["stream_options"]
    async with engine(answer_whole) as (url, seen), aiohttp.ClientSession() as s:
        router = keyed(url, Limits(budget=Budget(tokens=10_000_000, per="day")))
        async with serving(router) as base:
            # Streamed, by an alias: the model renamed, the usage event and running counts asked for,
            # and (a budget is a cap) the default completion limit set, in every field an engine
            # reads; the rest as sent.
            assert (await post(s, base, raw, key="sk-team"))[0] == 200
            assert received(seen) == {**body, "model": "chat", "max_tokens": 256, "max_completion_tokens": 256,
                                      "n_predict": 256,
                                      "stream_options": {"continuous_usage_stats": True, "include_usage": True}}
            # A tenant with a budget: every completion limit sent as what was reserved (20).
            assert (await post(s, base, json.dumps(capped).encode(), key="sk-team"))[0] == 200
            assert received(seen) == {**capped, "max_tokens": 20, "n_predict": 20}
            seen_by = await metrics(s, base)
    assert seen_by[("llmgw_router_body_parses_off_loop_total", ())] == 2  # both went through the worker


async def test_small_requests_are_answered_while_big_bodies_wait_for_the_parser(chat_sim: SimProcess) -> None:
    """Two senders of 8 MB bodies held the event loop; with the parser stopped dead (SIGSTOP),
    nothing but the big bodies waits, and at most one of them is in the worker at a time."""
    router = make_router(chat_sim, key_parse_bodies=3)  # one client here (an open router: by address) sends all 3
    async with serving(router) as base, aiohttp.ClientSession() as s:
        assert (await post(s, base, pathological("nope")))[0] == 404  # parsed (in the worker), then refused
        [worker] = parse_workers()
        os.kill(worker, signal.SIGSTOP)
        try:
            bigs = [asyncio.create_task(post(s, base, pathological("nope"))) for _ in range(3)]

            await until(lambda: parser_holds(s, base, 1, 2), "one big body in the stopped worker, two waiting")
            for i in range(5):
                status, answer = await post(s, base, json.dumps({"model": "chat", "messages": HI,
                                                                 "user": str(i)}).encode())
                assert status == 200 and answer["choices"][0]["message"]["content"], answer
            assert not any(t.done() for t in bigs)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert [status for status, _ in await asyncio.gather(*bigs)] == [404, 404, 404]


async def test_a_body_that_waits_too_long_for_the_parser_is_a_503_and_a_dead_parser_is_replaced(
        chat_sim: SimProcess) -> None:
    router = make_router(chat_sim, body_timeout=5.0)  # also how long a big body may wait for the parser
    async with serving(router) as base, aiohttp.ClientSession() as s:
        assert (await post(s, base, pathological("nope")))[0] == 404
        [worker] = parse_workers()
        os.kill(worker, signal.SIGSTOP)
        try:
            both = {asyncio.create_task(post(s, base, pathological("nope"))) for _ in range(2)}
            await until(lambda: parser_holds(s, base, 1, 1), "one big body in the stopped worker, one waiting")
            done, [parsing] = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            status, answer = done.pop().result()
            assert status == 503 and "busy" in answer["error"]["message"], answer
        finally:
            os.kill(worker, signal.SIGKILL)  # dies with a body in it (out of memory, a stray kill -9)
        status, answer = await parsing
        assert status == 503 and "stopped" in answer["error"]["message"], answer
        # The next big body gets a new worker and is served.
        big = json.dumps({"model": "chat", "messages": big_messages()}).encode()
        status, answer = await post(s, base, big)
        assert status == 200 and answer["choices"][0]["message"]["content"], answer
        assert len(parse_workers()) == 1
    assert parse_workers() == []  # the router's close stops its worker


async def test_a_big_batch_is_admitted_as_its_prompts_add_up() -> None:
    """A batch of prompts reserves each prompt's answers, however big the body: counted as one, a
    batch of 300 would have been admitted against a limit it needs 300 times over."""
    batch = ["Tell me a story about the number %d. " % i * 30 for i in range(300)]  # ~350 KB: the worker's
    async with engine(answer_whole) as (url, seen), aiohttp.ClientSession() as s:
        router = keyed(url, Limits(budget=Budget(tokens=200_000, per="day")))
        async with serving(router) as base:
            for prompts, status in ((batch, 400), (batch[:1] * 300, 400), (batch[0] * 300, 200)):
                data = json.dumps({"model": "chat", "prompt": prompts, "max_tokens": 1000}).encode()
                got, answer = await post(s, base, data, path=COMPLETIONS, key="sk-team")
                assert got == status, answer
                if status == 400:
                    assert answer["error"]["code"] == "exceeds_budget", answer
    assert len(seen) == 1  # one prompt of the same size: admitted and sent


async def test_without_parse_workers_every_body_is_parsed_inline(chat_sim: SimProcess) -> None:
    router = make_router(chat_sim, parse_workers=0)
    async with serving(router) as base, openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as c:
        r = await c.chat.completions.create(model="chat", messages=big_messages())  # type: ignore[arg-type]
        assert r.choices[0].message.content
        assert parse_workers() == []


# --- one key cannot hold the router's buffers or its parser (review 2) ---------------------------

TWO_KEYS = [{"name": "a-key", "sha256": hash_key("sk-a"), "models": ["*"]},
            {"name": "b-key", "sha256": hash_key("sk-b"), "models": ["*"]}]


def two_keys(url: str, **config: object) -> Router:
    router = Router(keys=KeyRing.from_entries(TWO_KEYS), config=RouterConfig(**config))  # type: ignore[arg-type]
    router.set_catalog(Catalog(models=(model("chat"),)))
    router.set_endpoints([endpoint("chat", url)])
    return router


async def start_upload(base: str, key: str, first: bytes, *, length: int | None = None,
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request whose body is still being sent: ``first`` of it (chunked, or a Content-Length)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    framing = b"Content-Length: %d" % length if length is not None else b"Transfer-Encoding: chunked"
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
                 + b"\r\nContent-Type: application/json\r\n" + framing + b"\r\n\r\n")
    writer.write(first if length is not None else b"%x\r\n%s\r\n" % (len(first), first))
    await writer.drain()
    return reader, writer


async def answer_of(reader: asyncio.StreamReader) -> tuple[int, dict]:
    async with asyncio.timeout(60):  # a hang guard
        head = await reader.readuntil(b"\r\n\r\n")
        size = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return int(head.split()[1]), json.loads(await reader.readexactly(size))


async def held(router: Router, size: int) -> bool:
    return router_metric(router, "llmgw_router_request_body_bytes") >= size


MB = 1024 * 1024


async def test_bodies_count_against_the_buffered_limit_as_they_are_read(chat_sim: SimProcess) -> None:
    """Counted only once whole, 12 concurrent uploads of 30 MB (each a byte short) all passed a
    64 MiB limit and the router held 340 MB. Counted as read, the upload that would pass it is a
    503 at once, and so is one whose Content-Length would."""
    router = two_keys(chat_sim.endpoint, body_limit=2 * MB, buffered_limit=3 * MB)
    async with serving(router) as base:
        _, first = await start_upload(base, "sk-a", b'{"model": "chat", "x": "' + b"a" * (3 * MB // 2))
        await until(lambda: held(router, 3 * MB // 2), "the first upload's bytes counted as they arrive")
        reader, second = await start_upload(base, "sk-b", b"b" * (3 * MB // 2) + b"x" * 100)
        status, answer = await answer_of(reader)
        assert status == 503 and "its limit (3145728)" in answer["error"]["message"], answer
        reader, third = await start_upload(base, "sk-b", b"", length=2 * MB)
        status, answer = await answer_of(reader)
        assert status == 503 and "its limit (3145728)" in answer["error"]["message"], answer
        for w in (first, second, third):
            w.close()
        await until(lambda: held_none(router), "every held byte given back when the uploads end")
        async with aiohttp.ClientSession() as s:
            assert (await post(s, base, json.dumps({"model": "chat", "messages": HI}).encode(), key="sk-b"))[0] == 200


async def held_none(router: Router) -> bool:
    return router_metric(router, "llmgw_router_request_body_bytes") == 0


async def test_one_key_holds_at_most_its_share_of_the_buffers() -> None:
    """One key filling buffered_limit made every other tenant's smallest request a 503: a key's
    own share is smaller, and going past it is that key's 429, nobody else's."""
    async with engine(answer_whole) as (url, _seen), aiohttp.ClientSession() as s:
        router = two_keys(url, body_limit=2 * MB, buffered_limit=8 * MB)  # a key: a quarter, at least body_limit
        async with serving(router) as base:
            await _past_the_share(router, base, s)


async def _past_the_share(router: Router, base: str, s: aiohttp.ClientSession) -> None:
    """Key a holds most of its share with an upload still being sent; key b is served meanwhile."""
    _, first = await start_upload(base, "sk-a", b'{"model": "chat", "x": "' + b"a" * (3 * MB // 2))
    await until(lambda: held(router, 3 * MB // 2), "the first upload's bytes counted as they arrive")
    reader, second = await start_upload(base, "sk-a", b"", length=MB)
    status, answer = await answer_of(reader)
    assert status == 429 and "one client may hold 2097152" in answer["error"]["message"], answer
    # Another key is served meanwhile, big body and small.
    big = json.dumps({"model": "chat", "messages": HI, "x": "b" * (3 * MB // 2)}).encode()
    assert (await post(s, base, big, key="sk-b"))[0] == 200
    assert (await post(s, base, json.dumps({"model": "chat", "messages": HI}).encode(), key="sk-b"))[0] == 200
    first.close()
    second.close()
    await until(lambda: held_none(router), "every held byte given back when the uploads end")


async def test_one_key_has_at_most_two_big_bodies_waiting_for_the_parser(chat_sim: SimProcess) -> None:
    """One key's big bodies kept the one parse worker busy, and another tenant's big body waited
    30 s for a 503. A key has two waiting or parsing at most; a third is its own 429."""
    router = two_keys(chat_sim.endpoint, body_timeout=60.0)
    async with serving(router) as base, aiohttp.ClientSession() as s:
        assert (await post(s, base, pathological("nope"), key="sk-a"))[0] == 404  # the worker started
        [worker] = parse_workers()
        os.kill(worker, signal.SIGSTOP)
        try:
            two = [asyncio.create_task(post(s, base, pathological("nope"), key="sk-a")) for _ in range(2)]
            await until(lambda: parser_holds(s, base, 1, 1), "one of a's big bodies in the stopped worker, one waiting")
            status, answer = await post(s, base, pathological("nope"), key="sk-a")
            assert status == 429, answer
            assert "the most one client may (2)" in answer["error"]["message"], answer
            other = asyncio.create_task(post(s, base, pathological("nope"), key="sk-b"))  # b's waits its turn
            await until(lambda: parser_holds(s, base, 1, 2), "b's big body waiting too")
        finally:
            os.kill(worker, signal.SIGCONT)
        assert [status for status, _ in await asyncio.gather(*two, other)] == [404, 404, 404]


async def test_a_body_with_more_values_than_the_parser_takes_is_a_400_naming_the_limit() -> None:
    """32 MB of `"":0` members held the parse worker for 17 s and 1.3 GB. Counted before parsing:
    more than 2,000,000 values, or more than 10,000 top-level members, is a 400. A long text full
    of commas is a few values, and is served."""
    many = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "x": [' + b"0," * 2_000_000 + b"0]}"
    members = b'{"model": "chat", ' + b'"": 0, ' * 10_001 + b'"messages": []}'
    commas = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "," * 2_100_000}]}).encode()
    async with engine(answer_whole) as (url, seen), aiohttp.ClientSession() as s, serving(two_keys(url)) as base:
        status, answer = await post(s, base, many, key="sk-a")
        assert (status, answer["error"]["code"]) == (400, "too_many_values"), answer
        assert "more than 2,000,000 JSON values" in answer["error"]["message"]
        status, answer = await post(s, base, members, key="sk-a")
        assert (status, answer["error"]["code"]) == (400, "too_many_members"), answer
        assert "more than 10,000 top-level members" in answer["error"]["message"]
        status, answer = await post(s, base, commas, key="sk-a")
        assert status == 200, answer
        assert received(seen)["messages"][0]["content"] == "," * 2_100_000
