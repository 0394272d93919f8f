"""A lean HTTP/1.1 client for the one thing the router does to engines: POST JSON, read the answer.

Why not ``aiohttp.ClientSession``: profiled under load, its general machinery (request objects,
header multidicts, payload wrappers, tracing hooks, a task per write) was close to half the
router's CPU per request, and the router is benchmarked against a bare pass-through (issue 6).
Engines speak plain HTTP/1.1 and the router needs little of it, so this client is a keep-alive
connection pool of :class:`asyncio.Protocol` objects: one ``write`` per request (head and body
together), a small response parser (Content-Length, chunked, or until close; 1xx skipped), and
the body handed over as the bytes arrive. What it does not do — redirects, cookies, proxies,
compression, HTTP/2 — engines do not need.

Failure semantics, which the router's retry depends on (:func:`llmgw.router.retry.next_step`):
every failure here raises :class:`UpstreamFailed` with one of three :class:`Reason` values.

- ``connect``: the request provably never reached the engine. Either no connection was made
  (refused, unreachable, a TLS error, or none within ``connect_timeout``), or a kept-alive
  connection was seen closed before the request was written. Only the latter is sent again here,
  once, on a fresh connection; a failed connect goes back to the router, which may try another
  replica without spending its retry budget.
- ``timeout``: the request was written and nothing came for ``read_timeout``, while waiting for
  the response head or between pieces of the body (not while the router itself has paused
  reading because its client is slow). The engine may still be generating: the router does not
  send the request elsewhere.
- ``disconnect``: the request was written, then the connection closed or broke, or the engine
  sent an answer this client will not read (malformed or ambiguous framing, a head, chunk line
  or trailers past the bounds below, more than ``MAX_INFORMATIONAL`` 1xx heads, a whole answer
  over ``MAX_WHOLE_ANSWER``), on which the connection is aborted. Never resent here: the engine
  may have read it and worked on it (a POST is not idempotent; aiohttp's client never resends
  one either), so whether to try elsewhere is the router's decision, on its retry budget
  (DESIGN §6).

The fourth reason, ``status``, is not raised here: :mod:`llmgw.router.proxy` raises it when an
engine answers 502, 503 or 504 before anything reached the client. ``UpstreamFailed.timeout`` is
set whenever a timeout passed, a connect timeout (reason ``connect``) included: the client is
then answered 504 rather than 502.
"""

from __future__ import annotations

import asyncio
import re
import ssl as _ssl
from collections import deque
from enum import StrEnum
from typing import NamedTuple
from urllib.parse import urlsplit

from llmgw.errors import LlmgwError

# The limits of what the router reads from an engine. Engines send a few short headers and
# small chunk lines; anything past these is a broken or hostile engine, and without a bound one
# could grow the router's memory without end (a size line that never ends, a 10 GB answer).
MAX_HEAD = 64 * 1024  # one response head, and all trailers of a chunked body together
MAX_HEADERS = 100
MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions, or one trailer line
MAX_CHUNK_DIGITS = 15  # hex digits of one chunk size: under 2**60 bytes
MAX_INFORMATIONAL = 8  # 1xx heads before the real one
MAX_WHOLE_ANSWER = 256 * 1024 * 1024  # a non-streamed answer, held whole before it is passed on
PAUSE_ABOVE = 1024 * 1024  # buffered, unread body bytes before reading from the engine pauses

_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _DONE = range(5)
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)
_DIGITS = frozenset(b"0123456789")
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9]{2})(?: |$)")  # 100-599: what a client can be given
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class Head(NamedTuple):
    """A response head as the body reader needs it (a tuple: built once per answer, on the hot path)."""

    status: int
    headers: dict[bytes, bytes]  # names lower-cased; a repeated header's values joined by ", "
    length: int | None
    chunked: bool
    keep_alive: bool


def parse_head(raw: bytes) -> Head | str:
    """The head (without its final blank line), or what is wrong with it.

    Ambiguous framing is refused, not guessed at: a repeated or comma-listed Content-Length,
    Content-Length together with Transfer-Encoding, a transfer coding other than a lone
    ``chunked`` (``chunked`` as a substring of another token once counted), bare LF or NUL in a
    line, a header name with spaces. A proxy and an engine that disagree on where an answer ends
    hand one client the start of the next client's answer.
    """
    crlf = raw.count(b"\r\n")
    if raw.count(b"\n") != crlf or raw.count(b"\r") != crlf or b"\0" in raw:
        return "sent a header line with a bare CR, LF or NUL"
    lines = raw.split(b"\r\n")
    status_line = _STATUS_LINE.match(lines[0])
    if status_line is None:
        return f"sent no HTTP/1.x status line: {lines[0][:40]!r}"
    if len(lines) - 1 > MAX_HEADERS:
        return f"sent more than {MAX_HEADERS} header lines"
    headers: dict[bytes, bytes] = {}
    lengths: list[bytes] = []
    codings: list[bytes] = []
    name = b""
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):  # obs-fold: the previous header's value goes on
            if not name:
                return "sent a continuation line before any header"
            value = line.strip(b" \t")
            headers[name] = (headers[name] + b" " + value).strip()
            if name == b"content-length":
                lengths[-1] = (lengths[-1] + b" " + value).strip()
            elif name == b"transfer-encoding":
                codings.append(value)
            continue
        raw_name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(raw_name) is None:
            return f"sent a malformed header line: {line[:40]!r}"
        name = raw_name.lower()
        value = value.strip(b" \t")
        headers[name] = headers[name] + b", " + value if name in headers else value
        if name == b"content-length":
            lengths.append(value)
        elif name == b"transfer-encoding":
            codings.append(value)
    tokens = [t.strip(b" \t").lower() for v in codings for t in v.split(b",") if t.strip(b" \t")]
    chunked = bool(codings)
    if codings and status_line.group(1) == b"0":  # RFC 9112 6.1: faulty framing on HTTP/1.0
        return "sent Transfer-Encoding on an HTTP/1.0 answer"
    if codings and tokens != [b"chunked"]:
        return f"sent Transfer-Encoding {headers[b'transfer-encoding'][:40]!r}; only a lone chunked is read"
    length = None
    if lengths:
        if chunked:
            return "sent both Content-Length and Transfer-Encoding"
        # int() would take "-1", "+5" and "1_0"; "5, 5" or two headers leave the end ambiguous
        if len(lengths) > 1 or not lengths[0] or not _DIGITS.issuperset(lengths[0]) or len(lengths[0]) > 18:
            return f"sent a malformed Content-Length: {headers[b'content-length'][:40]!r}"
        length = int(lengths[0])
    connection = headers.get(b"connection")
    keep_alive = status_line.group(1) == b"1" and not (
        connection and b"close" in {t.strip() for t in connection.lower().split(b",")})
    return Head(int(status_line.group(2)), headers, length, chunked, keep_alive)


class Reason(StrEnum):
    """Why an attempt failed; the retry decision (:func:`llmgw.router.retry.next_step`) reads it,
    and its value is the ``reason`` label of ``llmgw_router_retries`` (so the strings never change)."""

    CONNECT = "connect"  # provably never reached the engine: free to send again
    TIMEOUT = "timeout"  # nothing came for the read timeout: the engine may still be generating
    DISCONNECT = "disconnect"  # the connection closed or broke after the request was written
    STATUS = "status"  # the engine answered 502/503/504 before anything reached the client


class UpstreamFailed(LlmgwError):
    """The engine failed (or a timeout passed) — whether before or during the answer."""

    def __init__(self, reason: Reason, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.timeout = timeout


class Origin:
    """One engine address: its idle connections and the request head prefix per path."""

    __slots__ = ("host", "port", "ssl", "prefix", "label", "idle", "retired", "reuse")

    def __init__(self, url: str, *, reuse: bool = True) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.prefix = parts.path.rstrip("/")
        self.label = f"{parts.scheme}://{parts.netloc}"
        self.idle: list[Conn] = []
        self.retired = False  # its replica left the table: connections are closed, not kept
        self.reuse = reuse  # False: a connection per request (an engine that drops idle ones under load)

    def head(self, path: str) -> bytes:
        """The request head up to the Content-Length value, built once per path."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {host}:{self.port}\r\n"
                "Content-Type: application/json\r\nAccept-Encoding: identity\r\nContent-Length: ").encode()


class Conn(asyncio.Protocol):
    """One connection to an engine; one exchange at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.keep_alive = True
        self.received = False  # any byte of this exchange's answer
        self.unsent = False  # the request was never written: the engine cannot have seen it
        self._state = _HEAD
        self._buf = bytearray()
        self._left = 0
        self._chunk_state = _SIZE
        self._trailers = 0
        self._searched = 0
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._error: UpstreamFailed | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_io = 0.0

    # --- protocol callbacks ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self._error is not None:
            return  # already failed (a timeout, a malformed answer): that, not a clean end, is the news
        if self._state == _UNTIL_CLOSE and exc is None:  # only an orderly close ends such a body;
            self._state = _DONE                          # a reset cut it short
            self._wake()
        elif self._state != _DONE:
            when = ("after the request was sent, before answering (it may have worked on it)"
                    if not self.received else "mid-answer")
            self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} closed the connection {when}"
                                      + (f": {exc}" if exc else "")))

    def data_received(self, data: bytes) -> None:
        self._last_io = self.loop.time()
        self.received = True
        if self._state == _HEAD:
            self._buf += data
            self._parse_head()
        elif self._state != _DONE:
            self._body(data)
        # Bytes after the end of an answer (or on an idle connection) mean the stream is out of
        # step: never reuse it.
        elif data:
            self.keep_alive = False

    def pause_writing(self) -> None:  # requests are small; nothing to throttle
        pass

    # --- parsing --------------------------------------------------------------------------------
    def _parse_head(self) -> None:
        for _ in range(MAX_INFORMATIONAL + 1):
            buf = self._buf
            # From where the last search stopped (less the 3 bytes a split "\r\n\r\n" can leave):
            # a head trickled a byte at a time was searched from its start on every byte.
            end = buf.find(b"\r\n\r\n", max(0, self._searched - 3))
            if end < 0:
                self._searched = len(buf)
                if len(buf) > MAX_HEAD:
                    self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent a response head over "
                                                            f"{MAX_HEAD // 1024} KiB"))
                return
            if end > MAX_HEAD:
                self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent a response head over "
                                                        f"{MAX_HEAD // 1024} KiB"))
                return
            head = parse_head(bytes(buf[:end]))
            rest = bytes(buf[end + 4:])
            self._buf = bytearray()
            self._searched = 0
            if isinstance(head, str):
                self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} {head}"))
                return
            if not 100 <= head.status < 200:
                break
            self._buf += rest  # 100 Continue and friends: the real head follows
        else:
            self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent more than "
                                                    f"{MAX_INFORMATIONAL} informational (1xx) heads"))
            return
        status = head.status
        self.status, self.headers = status, head.headers
        self.keep_alive = head.keep_alive
        if status in (204, 304):
            self._state = _DONE
        elif head.chunked:
            self._state = _CHUNKED
        elif head.length is not None:
            self._left = head.length
            self._state = _LENGTH if self._left else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self.keep_alive = False
        self._wake()
        if rest and self._state != _DONE:
            self._body(rest)

    def _body(self, data: bytes) -> None:
        state = self._state
        if state == _LENGTH:
            if len(data) >= self._left:
                data, extra = data[:self._left], data[self._left:]
                if extra:
                    self.keep_alive = False
                self._left = 0
                self._state = _DONE
            else:
                self._left -= len(data)
            self._push(data)
        elif state == _CHUNKED:
            self._dechunk(data)
        else:
            self._push(data)

    def _dechunk(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        while True:
            cs = self._chunk_state
            if cs == _DATA:
                if pos >= len(buf):
                    break
                take = min(self._left, len(buf) - pos)
                out.append(bytes(buf[pos:pos + take]))
                pos += take
                self._left -= take
                if self._left == 0:
                    self._chunk_state = _DATA_END
            elif cs == _DATA_END:
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":  # the chunk is not the size it said: out of step
                    self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent a chunk longer than its "
                                                            "size line said"))
                    return
                pos += 2
                self._chunk_state = _SIZE
            else:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    if len(buf) - pos > MAX_CHUNK_LINE:
                        self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent a chunk line over "
                                                                f"{MAX_CHUNK_LINE} bytes"))
                        return
                    break
                if nl - pos > MAX_CHUNK_LINE:
                    self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent a chunk line over "
                                                            f"{MAX_CHUNK_LINE} bytes"))
                    return
                line = bytes(buf[pos:nl])
                pos = nl + 2
                if cs == _TRAILER:
                    if not line:
                        self._state = _DONE
                        break
                    self._trailers += len(line) + 2
                    if self._trailers > MAX_HEAD:
                        self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent trailers over "
                                                                f"{MAX_HEAD // 1024} KiB"))
                        return
                    continue
                digits = line.split(b";", 1)[0].strip(b" \t")
                # int(, 16) also takes "-5", "+5" and "5_0"; a negative size walked the parser
                # backwards over the same line forever, freezing the event loop.
                if not digits or not _HEX_DIGITS.issuperset(digits) or len(digits) > MAX_CHUNK_DIGITS:
                    self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent a malformed chunk"))
                    return
                size = int(digits, 16)
                if size == 0:
                    self._chunk_state = _TRAILER
                else:
                    self._left = size
                    self._chunk_state = _DATA
        del buf[:pos]
        if self._state == _DONE and len(buf):
            self.keep_alive = False
        if out:
            self._push(b"".join(out) if len(out) > 1 else out[0])
        elif self._state == _DONE:
            self._wake()

    def _push(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            if self._buffered > PAUSE_ABOVE and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: UpstreamFailed) -> None:
        self._error = error
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(error)

    # --- the exchange, from the router's side ----------------------------------------------------
    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._reset()
        if self.closed or self.transport.is_closing():
            # The engine closed it between connect and now; writing would be silently dropped and
            # the exchange would wait read_timeout for an answer that cannot come.
            self._error = UpstreamFailed(Reason.CONNECT, f"{self.origin.label} closed the connection before "
                                                    "the request was sent")
            self.unsent = True
            return
        self._last_io = self.loop.time()
        self._timer = self.loop.call_at(self._last_io + self.pool.read_timeout, self._check_timeout)
        self.transport.write(b"%s%d\r\n\r\n%s" % (head, len(body), body))

    def _check_timeout(self) -> None:
        limit = self.pool.read_timeout
        idle = self.loop.time() - self._last_io
        if self._state == _DONE or self._error is not None:
            self._timer = None
        elif self._paused or idle < limit:
            self._timer = self.loop.call_at(self._last_io + limit if not self._paused else self.loop.time() + limit,
                                            self._check_timeout)
        else:
            self._timer = None
            what = "an answer" if self.status == 0 else "the rest of its answer"
            self._fail(UpstreamFailed(Reason.TIMEOUT, f"{self.origin.label} sent nothing for {limit:g} s while "
                                                 f"the router waited for {what}", timeout=True))

    async def wait_head(self) -> None:
        while self.status == 0:
            await self._wait()

    async def read_chunk(self) -> bytes:
        """The next piece of the body as it arrived; ``b""`` at its end."""
        while True:
            if self._chunks:
                chunks = self._chunks
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self._last_io = self.loop.time()  # the engine's wait restarts now, not at the pause
                    self.transport.resume_reading()
                return data
            if self._state == _DONE:
                return b""
            await self._wait()

    async def read_all(self, limit: int = MAX_WHOLE_ANSWER) -> bytes:
        """The whole body, or :class:`UpstreamFailed` once it passes ``limit`` bytes."""
        parts = []
        size = 0
        while chunk := await self.read_chunk():
            size += len(chunk)
            if size > limit:
                self._fail(UpstreamFailed(Reason.DISCONNECT, f"{self.origin.label} sent an answer over "
                                                        f"{limit // (1024 * 1024)} MiB; it is not buffered"))
                raise self._error  # type: ignore[misc]
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    @property
    def complete(self) -> bool:
        return self._state == _DONE and self._error is None

    def release(self) -> None:
        """Back to the pool when the answer was read to its end and may be followed; else closed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.complete and self.keep_alive and not self.closed and not self._chunks:
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Drop the connection now: the engine sees its client go away and stops generating."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.closed = True
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to every engine; ``close()`` drops them all."""

    def __init__(self, *, connect_timeout: float, read_timeout: float, keepalive_timeout: float,
                 max_idle: int = 512) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive_timeout = keepalive_timeout
        self.max_idle = max_idle
        self._all: set[Conn] = set()
        self._ssl: _ssl.SSLContext | None = None

    async def request(self, origin: Origin, head: bytes, body: bytes) -> Conn:
        """Send ``body`` and return once the response head is in (status, headers); the caller reads
        the body and must ``release()`` or ``abort()`` the connection."""
        conn = self._reuse(origin)
        if conn is not None:
            conn.send(head, body)
            try:
                await conn.wait_head()
                return conn
            except UpstreamFailed:
                conn.abort()
                if not conn.unsent:
                    raise
                # Seen closed before the request was written: it never reached the engine.
            except BaseException:
                conn.abort()
                raise
        conn = await self._connect(origin)
        conn.send(head, body)
        try:
            await conn.wait_head()
        except BaseException:
            conn.abort()
            raise
        return conn

    def _reuse(self, origin: Origin) -> Conn | None:
        idle = origin.idle
        oldest = self.loop.time() - self.keepalive_timeout
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > oldest and conn.keep_alive:
                return conn
            conn.abort()
        return None

    async def _connect(self, origin: Origin) -> Conn:
        ssl = None
        if origin.ssl:
            ssl = self._ssl = self._ssl or _ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: Conn(self, origin), origin.host, origin.port, ssl=ssl),
                self.connect_timeout)
        except TimeoutError as exc:
            # "connect", not "timeout": nothing was sent, so trying another replica costs no work.
            raise UpstreamFailed(Reason.CONNECT, f"{origin.label}: no connection within {self.connect_timeout:g} s",
                                 timeout=True) from exc
        except OSError as exc:
            raise UpstreamFailed(Reason.CONNECT, f"cannot connect to {origin.label}: {exc.strerror or exc}") from exc
        self._all.add(conn)
        return conn

    def put(self, conn: Conn) -> None:
        idle = conn.origin.idle
        if len(idle) >= self.max_idle or conn.origin.retired or not conn.origin.reuse:
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        idle.append(conn)

    def sweep(self, origin: Origin) -> None:
        """Close ``origin``'s idle connections past the keep-alive time (all of them once it is
        retired: its replica left the table), so no socket lingers unused."""
        oldest = self.loop.time() - self.keepalive_timeout
        keep = []
        for conn in origin.idle:
            if origin.retired or conn.closed or conn.idle_since <= oldest:
                conn.abort()
            else:
                keep.append(conn)
        origin.idle[:] = keep

    def forget(self, conn: Conn) -> None:
        self._all.discard(conn)

    async def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._all.clear()
