"""The router's HTTP/1.1 client against a scripted raw TCP server: framing, reuse, failures."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from llmgw.engines.testing import free_port
from llmgw.router.proxy import parse_body, rewrite_model
from llmgw.router.upstream import PAUSE_ABOVE, Origin, UpstreamFailed, UpstreamPool

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []


@asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[tuple[Server, Origin]]:
    """A server that reads each request and lets ``script`` answer (given the request's index)."""
    state = Server()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                state.requests.append(head + await reader.readexactly(length))
                await script(reader, writer, len(state.requests) - 1)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield state, Origin(f"http://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


def pool(read_timeout: float = 5.0) -> UpstreamPool:
    return UpstreamPool(connect_timeout=1.0, read_timeout=read_timeout, keepalive_timeout=4.0)


async def send(p: UpstreamPool, origin: Origin, body: bytes = b'{"x": 1}') -> tuple[int, bytes]:
    conn = await p.request(origin, origin.head("/v1/chat/completions"), body)
    try:
        return conn.status, await conn.read_all()
    finally:
        conn.release()


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")


async def test_chunked_answer_split_at_every_byte_then_the_connection_is_reused() -> None:
    async def byte_by_byte(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        for i in range(len(CHUNKED)):
            w.write(CHUNKED[i:i + 1])
            await w.drain()
            await asyncio.sleep(0)

    async with scripted(byte_by_byte) as (server, origin):
        p = pool()
        assert await send(p, origin) == (200, b"hello world")
        assert await send(p, origin, b"{}") == (200, b"hello world")
        await p.close()
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert server.requests[0].endswith(b"Content-Length: 8\r\n\r\n{\"x\": 1}")


async def test_streamed_pieces_arrive_as_sent() -> None:
    # Each piece is written only once the client has read the one before: a pool that held a
    # piece back for the next one (or for the end) never gets the next one, whatever the pace.
    received = [asyncio.Event() for _ in range(3)]

    async def lockstep(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for word, read in zip((b"one", b"two", b"three"), received, strict=True):
            w.write(b"%x\r\n%s\r\n" % (len(word), word))
            await w.drain()
            await read.wait()
        w.write(b"0\r\n\r\n")

    async with scripted(lockstep) as (_, origin):
        p = pool()
        conn = await p.request(origin, origin.head("/v1/completions"), b"{}")
        pieces = []
        async with asyncio.timeout(30):  # a bound on a hang: a held-back piece never comes
            while piece := await conn.read_chunk():
                pieces.append(piece)
                received[len(pieces) - 1].set()
        conn.release()
        await p.close()
    assert pieces == [b"one", b"two", b"three"]


@pytest.mark.parametrize(("answer", "status", "body"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabcde", 200, b"abcde"),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok", 201, b"ok"),
    (b"HTTP/1.1 204 No Content\r\n\r\n", 204, b""),
    (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", 404, b""),
])
async def test_framings(answer: bytes, status: int, body: bytes) -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(answer)

    async with scripted(reply) as (server, origin):
        p = pool()
        for _ in range(2):
            assert await send(p, origin) == (status, body)
        await p.close()
    assert server.connections == 1


async def test_body_until_close() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await w.drain()
        w.close()

    async with scripted(reply) as (server, origin):
        p = pool()
        assert await send(p, origin) == (200, b"all of it")
        assert await send(p, origin) == (200, b"all of it")
        await p.close()
    assert server.connections == 2


async def test_an_idle_connection_closed_by_the_engine_is_replaced_transparently() -> None:
    async def once_then_close(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        await asyncio.sleep(0.05)
        w.close()  # no "Connection: close": the client learns only when it uses the connection

    async with scripted(once_then_close) as (server, origin):
        p = pool()
        assert await send(p, origin) == (200, b"ok")
        await asyncio.sleep(0.2)
        assert await send(p, origin) == (200, b"ok")
        await p.close()
    assert server.connections == 2


async def test_a_request_the_engine_read_then_dropped_is_never_sent_again() -> None:
    """The engine read the request (and may have generated for seconds) before the connection
    closed: sending it again would run the work twice. Only the router may try elsewhere."""
    async def drop_the_second(_r: asyncio.StreamReader, w: asyncio.StreamWriter, i: int) -> None:
        if i == 1:
            w.close()  # read, then dropped without an answer byte
            return
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async with scripted(drop_the_second) as (server, origin):
        p = pool()
        assert await send(p, origin) == (200, b"ok")
        with pytest.raises(UpstreamFailed) as err:
            await send(p, origin)
        assert err.value.reason == "disconnect" and "after the request was sent" in str(err.value)
        await p.close()
    assert server.connections == 1 and len(server.requests) == 2


async def test_failures_are_typed() -> None:
    p = pool(read_timeout=0.3)
    with pytest.raises(UpstreamFailed) as err:
        await send(p, Origin(f"http://127.0.0.1:{free_port()}"))
    assert err.value.reason == "connect"

    async def stall_after_head(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await asyncio.sleep(20)

    async with scripted(stall_after_head) as (_, origin):
        conn = await p.request(origin, origin.head("/v1/chat/completions"), b"{}")
        assert await conn.read_chunk() == b"abc"
        t0 = time.monotonic()
        with pytest.raises(UpstreamFailed) as err:
            await conn.read_chunk()
        # The pool's 0.3 s read timeout, not the origin's 20 s stall.
        assert err.value.reason == "timeout" and err.value.timeout and 0.2 < time.monotonic() - t0 < 10
        conn.release()

    async def hang_up(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.close()

    async with scripted(hang_up) as (_, origin):
        with pytest.raises(UpstreamFailed, match="before answering") as err:
            await send(p, origin)
        assert err.value.reason == "disconnect"

    async def garbage(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")

    async with scripted(garbage) as (_, origin):
        with pytest.raises(UpstreamFailed, match="malformed chunk"):
            await send(p, origin)
    await p.close()


async def test_idle_connections_are_swept() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async with scripted(reply) as (server, origin):
        # Fresh means younger than 2 s: no pause of a busy machine between the answer and the
        # sweep just after it comes near that.
        p = UpstreamPool(connect_timeout=1.0, read_timeout=1.0, keepalive_timeout=2.0)
        await send(p, origin)
        p.sweep(origin)
        assert len(origin.idle) == 1  # still fresh
        await asyncio.sleep(2.1)
        p.sweep(origin)
        assert origin.idle == []
        await send(p, origin)
        origin.retired = True  # its replica left the table
        p.sweep(origin)
        assert origin.idle == [] and server.connections == 2
        await p.close()


def reset(w: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed engine's kernel does."""
    w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


async def test_a_body_until_close_cut_by_a_reset_is_an_error_not_its_end() -> None:
    async def crash(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
        await w.drain()
        await asyncio.sleep(0.1)
        reset(w)

    async with scripted(crash) as (_, origin):
        p = pool()
        conn = await p.request(origin, origin.head("/v1/completions"), b"{}")
        assert await conn.read_chunk() == b"data: 1\n\n"
        with pytest.raises(UpstreamFailed) as err:
            await conn.read_chunk()
        assert err.value.reason == "disconnect"
        conn.release()
        await p.close()


async def test_a_body_until_close_cut_by_a_timeout_is_an_error_even_when_nobody_was_waiting() -> None:
    async def stall(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.0 200 OK\r\n\r\npart")
        await asyncio.sleep(20)  # far past the 0.2 s timeout: its close (the body's end) never comes first

    async with scripted(stall) as (_, origin):
        p = pool(read_timeout=0.2)
        conn = await p.request(origin, origin.head("/v1/completions"), b"{}")
        assert await conn.read_chunk() == b"part"
        await asyncio.sleep(0.5)  # the router is busy writing to its client when the timeout passes
        with pytest.raises(UpstreamFailed) as err:
            await conn.read_chunk()
        assert err.value.reason == "timeout"
        conn.release()
        await p.close()


async def test_time_paused_for_a_slow_reader_is_not_counted_against_the_engine() -> None:
    burst = b"x" * (PAUSE_ABOVE + 4096)
    resumed = asyncio.Event()

    async def burst_then_think(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(burst) + 4, burst))
        await resumed.wait()  # silent longer than read_timeout, all of it while the router is paused
        w.write(b"done")  # and at once once it reads again: well within read_timeout of that

    async with scripted(burst_then_think) as (_, origin):
        p = pool(read_timeout=1.0)
        conn = await p.request(origin, origin.head("/v1/completions"), b"{}")
        await asyncio.sleep(1.5)  # a slow client: the router paused reading the engine meanwhile
        resumed.set()
        assert await conn.read_all() == burst + b"done"
        conn.release()
        await p.close()


@pytest.mark.timeout(5)
@pytest.mark.parametrize("size", [b"-5", b"+5", b"5_0", b""])
async def test_a_chunk_size_that_is_not_hex_digits_fails_cleanly(size: bytes) -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%s\r\nhello\r\n0\r\n\r\n" % size)

    async with scripted(reply) as (_, origin):
        p = pool(read_timeout=1.0)
        with pytest.raises(UpstreamFailed, match="malformed chunk"):
            await send(p, origin)
        await p.close()


OK = b"HTTP/1.1 200 OK\r\n"


@pytest.mark.timeout(5)
@pytest.mark.parametrize(("answer", "error"), [
    (OK + b"Content-Length: abc\r\n\r\nhello", "malformed Content-Length"),
    (OK + b"Content-Length: -1\r\n\r\nhello", "malformed Content-Length"),
    (OK + b"Content-Length: 5, 5\r\n\r\nhello", "malformed Content-Length"),
    (OK + b"Content-Length: 5\r\nContent-Length: 3\r\n\r\nhello", "malformed Content-Length"),
    (OK + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello", "malformed Content-Length"),
    (OK + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
     "both Content-Length and Transfer-Encoding"),
    (OK + b"Transfer-Encoding: notchunked\r\n\r\nhello", "only a lone chunked"),
    (OK + b"Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "only a lone chunked"),
    (OK + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "only a lone chunked"),
    (OK + b"Content-Length : 5\r\n\r\nhello", "malformed header line"),
    (OK + b"no colon here\r\n\r\n", "malformed header line"),
    (OK + b"X-A: 1\nContent-Length: 5\r\n\r\nhello", "bare CR, LF or NUL"),
    (b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n", "no HTTP/1.x status line"),
    (b"ICY 200 OK\r\n\r\n", "no HTTP/1.x status line"),
    (b"HTTP/1.1 000 Zero\r\nContent-Length: 0\r\n\r\n", "no HTTP/1.x status line"),
    (b"HTTP/1.1 999 Nine\r\nContent-Length: 0\r\n\r\n", "no HTTP/1.x status line"),
    (b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "on an HTTP/1.0 answer"),
    (OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXY5\r\nworldZZ0\r\n\r\n", "longer than its size line"),
    (OK + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n", "more than 100 header lines"),
    (OK + b"X-Big: " + b"v" * 70_000 + b"\r\n\r\n", "head over 64 KiB"),
    (b"HTTP/1.1 100 Continue\r\n\r\n" * 9 + OK + b"Content-Length: 0\r\n\r\n", "informational"),
    (OK + b"Transfer-Encoding: chunked\r\n\r\n" + b"5;" + b"x" * 5000, "chunk line over 4096 bytes"),
    (OK + b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 16 + b"\r\nhello", "malformed chunk"),
    (OK + b"Transfer-Encoding: chunked\r\n\r\n0\r\n" + b"X-T: v\r\n" * 10_000, "trailers over 64 KiB"),
])
async def test_ambiguous_or_oversized_framing_fails_cleanly(answer: bytes, error: str) -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(answer)
        await w.drain()
        await asyncio.sleep(0.5)  # keep the connection open: the parser, not the close, must decide

    async with scripted(reply) as (_, origin):
        p = pool(read_timeout=3.0)
        with pytest.raises(UpstreamFailed, match=error) as err:
            await send(p, origin)
        assert err.value.reason == "disconnect"
        assert origin.idle == []  # never reused
        await p.close()


@pytest.mark.timeout(10)
async def test_a_whole_answer_over_the_limit_is_refused_not_buffered() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(OK + b"Content-Length: 3000000\r\n\r\n")
        for _ in range(30):
            w.write(b"x" * 100_000)
            await w.drain()

    async with scripted(reply) as (_, origin):
        p = pool(read_timeout=3.0)
        conn = await p.request(origin, origin.head("/v1/embeddings"), b"{}")
        with pytest.raises(UpstreamFailed, match="answer over 1 MiB"):
            await conn.read_all(limit=1024 * 1024)
        conn.release()
        assert origin.idle == []
        await p.close()


async def test_a_folded_header_continues_the_one_before_it() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain;\r\n charset=utf-8\r\nTransfer-Encoding:\r\n\tchunked\r\n"
                b"\r\n5\r\nhello\r\n0\r\n\r\n")

    async with scripted(reply) as (server, origin):
        p = pool(read_timeout=1.0)
        conn = await p.request(origin, origin.head("/v1/completions"), b"{}")
        assert await conn.read_all() == b"hello"
        assert conn.headers[b"content-type"] == b"text/plain; charset=utf-8"
        conn.release()
        assert await send(p, origin) == (200, b"hello")
        await p.close()
    assert server.connections == 1


async def test_connection_close_among_other_tokens_is_honoured() -> None:
    async def reply(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _i: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, Close\r\nContent-Length: 2\r\n\r\nok")

    async with scripted(reply) as (server, origin):
        p = pool()
        assert await send(p, origin) == (200, b"ok")
        assert origin.idle == []
        await p.close()
    assert server.connections == 1


async def test_a_fresh_connection_the_engine_closed_before_the_request_fails_at_once() -> None:
    closed = asyncio.Event()

    async def close_at_once(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()  # accepted, then closed unread: an engine shutting down
        await w.wait_closed()
        closed.set()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    origin = Origin(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    p = pool(read_timeout=60.0)
    try:
        conn = await p._connect(origin)
        await asyncio.wait_for(closed.wait(), 30)  # the engine has closed its end (the FIN is sent)...
        await asyncio.sleep(0.1)  # ...and the router's loop reads it before its request is written
        conn.send(origin.head("/v1/completions"), b"{}")
        t0 = time.monotonic()
        with pytest.raises(UpstreamFailed) as err:
            await conn.wait_head()
        assert err.value.reason == "connect" and time.monotonic() - t0 < 30  # the close, not the read timeout
        conn.abort()
    finally:
        await p.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("raw", [
    b'{"model": "alias", "messages": [{"role": "user", "content": "half an emoji \\ud83d"}]}',
    b'{"model": "alias", "prompt": "\\udc00 alone"}',
])
def test_a_rewrite_keeps_lone_surrogates_valid(raw: bytes) -> None:
    body, asked, _ = parse_body(raw)
    out = rewrite_model(raw, body, asked, "real")
    assert json.loads(out) == {**json.loads(raw), "model": "real"}


def test_a_rewrite_never_sends_invalid_json() -> None:
    raw = b'{"model": "alias", "temperature": 1e400, "prompt": "\\u00e9"}'
    body, asked, _ = parse_body(raw)
    out = rewrite_model(raw, body, asked, "real")
    assert b"Infinity" not in out and json.loads(out)["model"] == "real"
