"""Forwarding one request to one engine: the body in, the answer (or its SSE stream) out.

This is the request path, measured against a bare aiohttp pass-through, so it does only what
it must: the body is parsed once (the ``model`` and ``stream`` fields are needed, and malformed
JSON must be refused before an engine sees it; :mod:`llmgw.router.parse`, off the event loop
when big), the model name is replaced in the raw bytes when that is provably safe, and the
answer's bytes are passed on as they arrive — one ``write`` per chunk the engine sent,
``X-Accel-Buffering: no`` so an nginx in front does not hold them back.

Failure before the first byte reaches the client — connection refused, a timeout, the engine
dropping the connection, or 502/503/504 from the engine — raises :class:`UpstreamFailed`, and
the caller may try another replica, because the client has seen nothing yet. That is why a
stream's headers are sent only once the engine's first chunk is in hand. After that, a failure
ends the stream with an SSE error event (the OpenAI SDK raises it as an ``APIError``) instead
of a silent truncation. A client that goes away closes the upstream connection at once, which
is how an engine learns to stop generating.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from llmgw import jsonbody
from llmgw.router.answer import TAIL_CHUNKS
from llmgw.router.parse import BadBody as BadBody  # re-exported: where callers have found it
from llmgw.router.parse import parse_body as parse_body
from llmgw.router.upstream import Conn, Origin, Reason, UpstreamFailed, UpstreamPool
from llmgw.router.usage import Meter, Relay, content_events, whole_events

RETRYABLE_STATUS = frozenset({502, 503, 504})
MODEL_HEADER = "x-llmgw-model"
_WS = re.compile(r"[ \t\n\r]*")


def _skip_ws(text: str, i: int = 0) -> int:
    """The index of the first non-whitespace character at or after ``i`` (the pattern always matches)."""
    return _WS.match(text, i).end()  # type: ignore[union-attr]
_DECODER = json.JSONDecoder()
# Status recorded when the client went away before the answer was complete (nginx's convention).
CLIENT_GONE = 499
SSE_DONE = b"data: [DONE]"  # an OpenAI stream's last event
_DONE_ALONE = (SSE_DONE, b"data:[DONE]")  # a stream with nothing before its marker
_DONE_LINES = tuple(b"\n" + done for done in _DONE_ALONE)


def rewrite_model(raw: bytes, body: dict[str, Any], asked: str, served: str) -> bytes:
    """``raw`` with the top-level ``model`` set to ``served``; everything else byte for byte.

    Fast path: when ``"model"`` occurs exactly once in the bytes and nothing is written with
    ``\\u`` escapes, that one occurrence is the top-level key (a JSON string *containing* the
    word has its quotes escaped, and the only other way to spell the key is with ``\\u``), so
    its value is replaced in place. Otherwise the top-level object is walked to find the value's
    span, which is replaced in the same way. Only a body that is not UTF-8 is re-serialised from
    the parsed body: re-serialising a UTF-8 one would turn ``1e400`` into ``Infinity`` (not JSON)
    and fail to encode an escaped lone surrogate (``"\\ud83d"``, half an emoji cut by a client).
    """
    if asked == served:
        return raw
    if any(type(v) is jsonbody.RawJSON for v in body.values()):
        # A big body parsed in the worker (llmgw.router.parse): its parts are text already, and
        # finding the span here would parse them on the event loop after all.
        return jsonbody.dumps({**body, "model": served})
    if raw.count(b'"model"') == 1 and b"\\u" not in raw:
        old = json.dumps(asked, ensure_ascii=False).encode()
        new = json.dumps(served, ensure_ascii=False).encode()
        for key in (b'"model":', b'"model": '):
            i = raw.find(key + old)
            if i >= 0:
                j = i + len(key) + len(old)
                return raw[:i] + key + new + raw[j:]
    try:
        text = raw.decode()
    except UnicodeDecodeError:  # UTF-16/32, which json.loads also reads
        text = ""
    span = _top_level_span(text, "model") if text else None
    if span is not None:
        return (text[:span[0]] + json.dumps(served, ensure_ascii=False) + text[span[1]:]).encode()
    return jsonbody.dumps({**body, "model": served})  # a lone surrogate is kept as its escape


def _top_level_span(text: str, key: str) -> tuple[int, int] | None:
    """Where the value of ``key`` in the JSON object ``text`` starts and ends (the last one when
    the key repeats, as ``json.loads`` keeps the last); None when the text is not such an object."""
    span = None
    i = _skip_ws(text)
    if text[i:i + 1] != "{":
        return None
    i = _skip_ws(text, i + 1)
    if text[i:i + 1] == "}":
        return None
    try:
        while True:
            if text[i:i + 1] != '"':
                return None
            name, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            i = _skip_ws(text, i)
            if text[i:i + 1] != ":":
                return None
            start = _skip_ws(text, i + 1)
            _, end = _DECODER.raw_decode(text, start)
            if name == key:
                span = (start, end)
            i = _skip_ws(text, end)
            if text[i:i + 1] == "}":
                return span
            if text[i:i + 1] != ",":
                return None
            i = _skip_ws(text, i + 1)
    except ValueError:
        return None


async def _open(pool: UpstreamPool, origin: Origin, head: bytes, data: bytes) -> Conn:
    """Send the request and wait for the response head; :class:`UpstreamFailed` if that did not work."""
    conn = await pool.request(origin, head, data)
    if conn.status in RETRYABLE_STATUS:
        try:
            text = (await conn.read_all())[:300].decode("utf-8", "replace")
        except UpstreamFailed:
            text = ""
        finally:
            conn.release()
        raise UpstreamFailed(Reason.STATUS, f"{origin.label} answered {conn.status} {text}".rstrip())
    return conn


def _headers(conn: Conn, served: str) -> dict[str, str]:
    return {"Content-Type": conn.headers.get(b"content-type", b"application/json").decode("latin-1"),
            MODEL_HEADER: served}


# Given the end of an answer (the whole body, or the last chunks of a stream written to its
# client), the stream's content events, the engine's running count at the last event written
# (None: none came, or not a stream), and whether the answer was complete (read to its end): see
# answer.py and usage.py.
# What an answer's end is told (its tail, content events, the engine's running count, whole or not);
# it may return the (prompt, completion) tokens it counted.
Tap = Callable[[bytes, int, tuple[int, int] | None, bool], tuple[int, int] | None]


async def forward_whole(pool: UpstreamPool, origin: Origin, head: bytes, data: bytes, served: str,
                        tap: Tap | None = None) -> web.Response:
    """A non-streamed request: the engine's whole answer, status and content type kept."""
    conn = await _open(pool, origin, head, data)
    try:
        body = await conn.read_all()
    finally:
        conn.release()  # back to the pool when read to the end, else dropped
    if tap is not None:
        tap(body if conn.status == 200 else b"", 0, None, conn.status == 200)
    return web.Response(status=conn.status, body=body, headers=_headers(conn, served))


async def forward_stream(pool: UpstreamPool, origin: Origin, head: bytes, data: bytes, served: str,
                         request: web.Request, on_first: Callable[[], None],
                         tap: Tap | None = None, relay: Relay | None = None,
                         on_end: Callable[[], None] | None = None) -> tuple[web.StreamResponse, int]:
    """A streamed request, passed through chunk by chunk. Returns the response and the status
    to record: the engine's, 502 when it failed mid-stream, 499 when the client went away.
    ``relay``: what the router asked the engine for on the client's behalf, taken out again
    (then a piece that ends inside an event waits for the rest of it, so what is taken out is
    always whole, and an event the engine never finished is not passed on before the error
    event that says the stream was cut), and where the engine's running count is; ``tap`` gets
    what was written. ``on_first`` runs when the engine's first chunk came, ``on_end`` when its
    end marker did: the engine's pace, not the client's (a slow reader delays only the writes)."""
    conn = await _open(pool, origin, head, data)
    try:
        content_type = conn.headers.get(b"content-type", b"")
        if conn.status != 200 or not content_type.startswith(b"text/event-stream"):
            # An error (or an engine that ignored "stream"): answered whole.
            body = await conn.read_all()
            if tap is not None:
                tap(body if conn.status == 200 else b"", 0, None, conn.status == 200)
            return web.Response(status=conn.status, body=body, headers=_headers(conn, served)), conn.status
        chunk = await conn.read_chunk()  # a failure here is still before the client saw anything
        on_first()
        out = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            MODEL_HEADER: served,
        })
        try:
            await out.prepare(request)
            status = 200
            tail: deque[bytes] | None = None if tap is None else deque(maxlen=TAIL_CHUNKS)
            meter = None if tap is None or relay is None else Meter(relay)
            strip = None if relay is None else relay.strip
            held = b""  # the start of an event not whole yet, when something is taken out
            events = 0
            complete = False
            before = b""  # the chunk before this one: the end marker may be split over two reads
            try:
                while chunk:
                    # The engine's end marker makes the answer whole, whatever happens to the
                    # body's last bytes: a client that got it may hang up at once (the sync
                    # openai client does), and its usage, just before, is the engine's count.
                    # Seen before the write: when it came is the engine's pace, not the client's.
                    ends = not complete and _ends_stream(chunk, before)
                    if ends and on_end is not None:
                        on_end()
                    piece = chunk
                    if strip is not None:
                        if held:
                            piece, held = held + piece, b""
                        end = whole_events(piece)
                        if end < len(piece) and end + _HELD_MAX > len(piece):
                            piece, held = piece[:end], piece[end:]
                        if piece:
                            await out.write(strip(piece))
                    else:
                        await out.write(piece)
                    # Counted once written: a client gone before this piece is not charged for it.
                    if tail is not None and piece:
                        tail.append(piece)
                        events += content_events(piece)
                        if meter is not None:
                            meter.written(piece)
                    complete = complete or ends
                    before = chunk
                    try:
                        chunk = await conn.read_chunk()
                    except UpstreamFailed as exc:
                        if held and complete:  # after the end marker: passed on as it came
                            await _write_counted(out, held, tail, meter)
                        if not complete:  # after the end marker the client has all it needs
                            await out.write(_sse_error(f"the engine failed mid-stream: {exc}"))
                            status = 502
                        break
                else:
                    if held and complete:
                        await _write_counted(out, held, tail, meter)
                    if not complete:
                        # A body that ends cleanly before the end marker is cut all the same (an
                        # engine or a proxy in front of it that gave up): the client is told, as
                        # for a connection that breaks, and the replica is charged with an error.
                        # Every engine the router fronts ends its OpenAI streams with the marker
                        # (vLLM, SGLang, the simulator; llama.cpp's server checked in
                        # tests/router/test_replica_stats_errors.py).
                        await out.write(_sse_error("the engine ended the stream before its end marker"))
                        status = 502
                await out.write_eof()
            finally:
                if tap is not None:
                    tap(b"".join(tail or ()), events, None if meter is None else meter.count(), complete)
        except ConnectionResetError:
            return out, CLIENT_GONE  # the client left; release() below drops the upstream request
        return out, status
    finally:
        # Back to the pool only when the answer was read to its end; otherwise the connection is
        # dropped, which is how the engine learns that nobody is listening and stops generating.
        conn.release()


# A piece longer than this with no whole event in it is passed on as it came (a stream that is not
# SSE after all must not be held back whole).
_HELD_MAX = 1 << 20


async def _write_counted(out: web.StreamResponse, piece: bytes, tail: deque[bytes] | None,
                         meter: Meter | None) -> None:
    """What followed the end marker's last whole event, written as it came (and counted: written)."""
    await out.write(piece)
    if tail is not None:
        tail.append(piece)
        if meter is not None:
            meter.written(piece)


def _ends_stream(chunk: bytes, before: bytes) -> bool:
    """Whether ``chunk`` (read after ``before``) ends with the end marker, as ``data: [DONE]``
    or ``data:[DONE]`` (SSE's space is optional), on a line of its own: text the model generates
    sits in a JSON string, where a newline is escaped."""
    end = chunk[-32:].rstrip()
    if len(end) < 32:  # the marker may have begun in the read before (a short last read)
        end = (before[-32:] + end).lstrip()
    return end.endswith(_DONE_LINES) or end in _DONE_ALONE


def _sse_error(message: str) -> bytes:
    err = {"error": {"message": message, "type": "upstream_error", "param": None, "code": "upstream_failed"}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"
