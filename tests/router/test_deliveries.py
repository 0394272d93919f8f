"""One client request reaches engines at most twice, and the same engine at most once (DESIGN §6).

The engines are raw sockets that count every request they read: one that reads and drops the
connection (the case where the pool used to resend, and the router retried, four deliveries in
all), one that reads and never answers (a first-byte timeout must not regenerate elsewhere).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import openai
import pytest

from llmgw.catalog.model import Catalog
from llmgw.router import Router, RouterConfig
from llmgw.router.retry import RetryBudget, next_step
from tests.router.conftest import client, endpoint, serving
from tests.router.fake_controller import model

HELLO = [{"role": "user", "content": "Hello"}]
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def engine(script: Script) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A raw engine: reads each request whole (head and Content-Length body), records it, runs script;
    a GET (the router's load poll) is answered 404."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"POST"):  # the router's load poll: not an engine's work
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                seen.append(head + await reader.readexactly(length))
                await script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
    finally:
        server.close()


async def write_completion(w: asyncio.StreamWriter, prompt: int, completion: int) -> None:
    """A whole chat completion that says it used ``prompt`` + ``completion`` tokens."""
    body = json.dumps({"id": "x", "object": "chat.completion", "model": "chat", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion}}).encode()
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await w.drain()


async def read_then_drop(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await asyncio.sleep(0.2)  # worked on it a while
    w.transport.abort()
    raise ConnectionError


async def read_then_hang(_r: asyncio.StreamReader, _w: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


def router_for(urls: list[str], **config: float) -> Router:
    router = Router(config=RouterConfig(cooldown=0.0, **config))  # type: ignore[arg-type]
    router.set_catalog(Catalog(models=(model("chat"),)))
    router.set_endpoints([endpoint("chat", url, f"chat-g{i}") for i, url in enumerate(urls)])
    return router


def deliveries(seen: dict[str, list[bytes]]) -> dict[str, Counter[str]]:
    """Per request (its prompt, unique to it), how many times each engine read it."""
    counts: dict[str, Counter[str]] = {}
    for name, requests in seen.items():
        for raw in requests:
            prompt = json.loads(raw.split(b"\r\n\r\n", 1)[1])["messages"][-1]["content"]
            counts.setdefault(prompt, Counter())[name] += 1
    return counts


async def test_engines_that_read_and_drop_see_the_request_at_most_twice_in_all() -> None:
    async with engine(read_then_drop) as (a, seen_a), engine(read_then_drop) as (b, seen_b), \
            engine(read_then_drop) as (c, seen_c):
        async with serving(router_for([a, b, c], retries=3)) as base, client(base) as cl:
            # Warm a keep-alive connection to each engine first: the old pool resent on those.
            for i in range(2):
                with pytest.raises(openai.APIStatusError) as err:
                    await cl.chat.completions.create(model="chat", messages=[{"role": "user", "content": f"Hello {i}"}])
            assert err.value.status_code == 502
            assert "after the request was sent" in err.value.message
    # Counted per request: totals over both (as this test once counted) cannot tell one request
    # read twice by one engine from two requests read once each.
    counts = deliveries({"a": seen_a, "b": seen_b, "c": seen_c})
    assert set(counts) == {"Hello 0", "Hello 1"}, counts
    for prompt, engines in counts.items():
        assert sum(engines.values()) <= 2, (prompt, counts)  # at most two deliveries
        assert max(engines.values()) == 1, (prompt, counts)  # never the same engine twice


async def test_a_first_byte_timeout_is_not_regenerated_elsewhere() -> None:
    async with engine(read_then_hang) as (a, seen_a), engine(read_then_hang) as (b, seen_b):
        async with serving(router_for([a, b], first_byte_timeout=0.5)) as base, client(base) as cl:
            with pytest.raises(openai.APIStatusError) as err:
                await cl.chat.completions.create(model="chat", messages=HELLO)
            assert err.value.status_code == 504
    assert len(seen_a) + len(seen_b) == 1


def test_the_retry_budget_is_a_share_of_live_requests_with_a_floor() -> None:
    budget = RetryBudget(ratio=0.2, floor=3, live=100)
    budget.retrying = 19
    assert budget.allows()
    budget.retrying = 20
    assert not budget.allows()
    quiet = RetryBudget(ratio=0.2, floor=3, live=1)
    assert quiet.allows()
    quiet.retrying = 3
    assert not quiet.allows()


def test_a_ticket_counts_its_request_live_and_gives_its_retry_back() -> None:
    budget = RetryBudget(ratio=0.0, floor=1)
    with budget.ticket() as first, budget.ticket() as second:
        assert budget.live == 2
        assert first.spend() and first.spend()  # one request holds one retry, however often it asks
        assert not second.spend()  # the floor of one is taken
    assert (budget.live, budget.retrying) == (0, 0)


def test_next_step_never_delivers_three_times_and_never_retries_a_timeout() -> None:
    assert next_step("timeout", deliveries=1, attempts=1, retries=5) == "stop"
    assert next_step("disconnect", deliveries=1, attempts=1, retries=5) == "spend"
    assert next_step("disconnect", deliveries=2, attempts=2, retries=5) == "stop"
    assert next_step("status", deliveries=1, attempts=1, retries=0) == "stop"
    assert next_step("connect", deliveries=0, attempts=1, retries=1) == "retry"
    assert next_step("connect", deliveries=0, attempts=4, retries=1) == "stop"


async def test_bodies_in_flight_have_a_total_cap_not_only_a_cap_each() -> None:
    async with engine(read_then_hang) as (a, seen_a):
        router = router_for([a], first_byte_timeout=60.0, buffered_limit=1500)
        async with serving(router) as base, client(base) as cl:
            big = [{"role": "user", "content": "x" * 900}]
            first = asyncio.ensure_future(cl.chat.completions.create(model="chat", messages=big))
            async with asyncio.timeout(30):  # the first body is held while its engine thinks
                while not seen_a:
                    await asyncio.sleep(0.02)
            with pytest.raises(openai.APIStatusError) as err:
                await cl.chat.completions.create(model="chat", messages=big)
            assert err.value.status_code == 503 and "request bodies in flight" in err.value.message
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
    assert len(seen_a) == 1  # the refused one never reached the engine
