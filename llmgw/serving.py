"""One way to serve HTTP, used by every listener of every llmgw process (DESIGN §6).

The router, the admin API and the dashboard, in `llmgw controller`, `llmgw up` and `llmgw
router` alike, listen through :func:`listen`: a client that goes away cancels its handler (and
so the engine's work), shutdown lets in-flight requests finish for a bounded time, the backlog
is deep enough for a burst, and idle keep-alive connections are closed. A separate wiring per
process is how `up` once kept an engine busy for a client that had left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

# A closed terminal (HUP) stops a process as INT and TERM do: `up` under a terminal that goes
# away must not leave its engines behind.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Also the number of connections asyncio accepts in one go before any of them is handed to a
# protocol: with 1,024, a burst of idle clients took every descriptor before the cap below could
# turn one away. 128 is Linux's old somaxconn: deep enough for a burst, shallow enough for that.
BACKLOG = 128
# Idle connections are closed after this: each one holds a descriptor. aiohttp starts the timer
# when a connection opens and restarts it only after an answer, so it is also the bound on the
# time a client has to send a complete request head (a slowloris sending a byte every few
# seconds is cut at this many seconds, not kept forever).
KEEPALIVE_TIMEOUT = 15.0


# Descriptors kept free of any listener's connections: git, SQLite, SSH to nodes, the other
# listener. A flood of idle connections on the router once took them all ("Too many open files"
# for the admin API and git fetch alike).
RESERVED_FDS = 256
_BUSY_BODY = b'{"error": {"message": "Too many open connections.", "type": "server_error", "code": "overloaded"}}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class _Busy(asyncio.Protocol):
    """A connection over the cap: told so and closed at once, its descriptor freed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(BUSY)  # type: ignore[attr-defined]
        transport.close()


_log = logging.getLogger("llmgw.serving")


class _RateLimited:
    """Repeats of one message let through once per ``interval`` seconds, with the count held back
    (seen: asyncio logs every failed accept, ~300 MB in 15 s under a descriptor flood)."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.last: dict[str, tuple[float, int]] = {}

    def allow(self, key: str, now: float) -> int | None:
        """The number of repeats held back since the last one let through, or None to hold this one."""
        last, skipped = self.last.get(key, (-self.interval, 0))
        if now - last < self.interval:
            self.last[key] = (last, skipped + 1)
            return None
        self.last[key] = (now, 0)
        return skipped


class _Handler(RequestHandler):
    """aiohttp's connection handler, with its own error answers in the OpenAI format.

    aiohttp answers what its HTTP parser rejects (a garbage request line, a header over 8 KiB, a
    bad chunk in an upload) and what a handler raised in plain text, and logs each with a
    traceback: a client sending junk in a loop filled the log.
    """

    __slots__ = ("_openai_errors", "_bad_requests")

    def __init__(self, server: web.Server, *, openai_errors: bool, bad_requests: _RateLimited,
                 **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self._openai_errors = openai_errors  # else the admin API's {"error": "..."}
        self._bad_requests = bad_requests  # the listener's: one per server, not one per process

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # an answer is under way: nothing to add but a close
            _log.error("%s from %s after the answer had begun", status, getattr(request, "remote", "?"),
                       exc_info=exc)
            raise ConnectionError("the answer was under way when the request failed")
        if status >= 500:
            text, code, kind = "The server failed while answering; the error is in its log.", "internal_error", \
                "server_error"
        else:
            reason = (message or (str(exc) if exc else "")).strip().splitlines()
            text = "The request is not valid HTTP/1.1" + (f": {reason[0][:200].rstrip(':')}" if reason else ".")
            code, kind = "bad_http", "invalid_request_error"
        key = f"{status} {type(exc).__name__}"
        skipped = self._bad_requests.allow(key, self._loop.time())
        if skipped is not None:
            more = f" ({skipped} more like it not logged)" if skipped else ""
            # A traceback only for our own failures; a client's bad bytes are one line.
            _log.warning("%s from %s: %s%s", status, getattr(request, "remote", "?"), text, more,
                         exc_info=exc if status >= 500 else None)
        error = {"message": text, "type": kind, "param": None, "code": code} if self._openai_errors else text
        resp = web.Response(status=status, body=json.dumps({"error": error}).encode(), content_type="application/json")
        resp.force_close()
        return resp


class _CappedSite(web.TCPSite):
    """A TCP site that accepts at most ``max_connections`` open connections at once."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, max_connections: int,
                 openai_errors: bool) -> None:
        super().__init__(runner, host, port, reuse_address=True, backlog=BACKLOG)
        self.max_connections = max_connections
        self.openai_errors = openai_errors
        self.bad_requests = _RateLimited()  # what its connections log of clients' bad bytes

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        cap = self.max_connections

        loop = asyncio.get_running_loop()

        def factory() -> asyncio.Protocol:
            if len(server.connections) >= cap:
                return _Busy()
            # What web.Server() builds, with our handler class; _kwargs are the runner's options.
            return _Handler(server, loop=loop, openai_errors=self.openai_errors, bad_requests=self.bad_requests,
                            **server._kwargs)

        self._server = await loop.create_server(
            factory, self._host, self._port, backlog=self._backlog, reuse_address=True)


class _Throttle:
    """The event loop's exception handler, with repeats of one message logged once per interval."""

    def __init__(self) -> None:
        self.limit = _RateLimited()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        key = str(context.get("message")) + type(context.get("exception")).__name__
        skipped = self.limit.allow(key, loop.time())
        if skipped is None:
            return
        if skipped:
            context = dict(context, message=f"{context.get('message')} ({skipped} more like it not logged)")
        loop.default_exception_handler(context)


def throttle_loop_errors() -> None:
    """Install the throttled exception handler on the running loop."""
    asyncio.get_running_loop().set_exception_handler(_Throttle())


def connection_cap(share: float) -> int:
    """``share`` of the descriptors this process may open, less the reserve."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, int((soft - RESERVED_FDS) * share))


async def listen(app: web.Application, host: str, port: int, *, drain_timeout: float,
                 max_connections: int, openai_errors: bool = True) -> web.AppRunner:
    """Serve ``app`` on ``host:port``; ``runner.cleanup()`` stops accepting, then drains."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=drain_timeout, keepalive_timeout=KEEPALIVE_TIMEOUT)
    await runner.setup()
    try:
        await _CappedSite(runner, host, port, max_connections=max_connections, openai_errors=openai_errors).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def raise_fd_limit() -> None:
    """Take every descriptor allowed: each proxied request holds two sockets (client, engine),
    and at the common soft limit of 1,024 a flood of idle clients starved git and the admin API."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def body_encoding_refused(request: web.BaseRequest) -> str | None:
    """Why a request's body is not read: a ``Content-Encoding`` other than identity, else None.

    aiohttp decompresses request bodies, and every size limit then applies to what comes out: 352 KB
    of gzip sent became 344 MB held by the router. No client of llmgw (OpenAI SDKs, git hosts, the
    CLI, standalone routers) compresses a request body, so none is read (a 415) rather than a ratio
    bounded."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    return (f"Request bodies sent with Content-Encoding `{encoding[:40]}` are not accepted here; "
            "send the body uncompressed.")


async def read_plain(request: web.BaseRequest) -> bytes:
    """The request's body, uncompressed as sent: a 415 for a compressed one
    (:func:`body_encoding_refused`), a 400 for one that cannot be read (never a 500)."""
    refused = body_encoding_refused(request)
    if refused is not None:
        raise web.HTTPUnsupportedMediaType(text=refused)
    try:
        return await request.read()
    except RequestPayloadError as exc:
        raise web.HTTPBadRequest(text=f"The request body could not be read: {exc}") from None
