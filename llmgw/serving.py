"""One way to serve HTTP, used by every listener of every llmgw process (DESIGN §6).

The router, the admin API and the dashboard, in `llmgw controller`, `llmgw up` and `llmgw
router` alike, listen through :func:`listen`: a client that goes away cancels its handler (and
so the engine's work), shutdown lets in-flight requests finish for a bounded time, the backlog
is deep enough for a burst, and idle keep-alive connections are closed. A separate wiring per
process is how `up` once kept an engine busy for a client that had left.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from aiohttp import web

# A closed terminal (HUP) stops a process as INT and TERM do: `up` under a terminal that goes
# away must not leave its engines behind.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Also the number of connections asyncio accepts in one go before any of them is handed to a
# protocol: with 1,024, a burst of idle clients took every descriptor before the cap below could
# turn one away. 128 is Linux's old somaxconn: deep enough for a burst, shallow enough for that.
BACKLOG = 128
# Idle keep-alive connections are closed after this: each one holds a descriptor.
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


class _CappedSite(web.TCPSite):
    """A TCP site that accepts at most ``max_connections`` open connections at once."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, max_connections: int) -> None:
        super().__init__(runner, host, port, reuse_address=True, backlog=BACKLOG)
        self.max_connections = max_connections

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        cap = self.max_connections

        def factory() -> asyncio.Protocol:
            return _Busy() if len(server.connections) >= cap else server()

        self._server = await asyncio.get_running_loop().create_server(
            factory, self._host, self._port, backlog=self._backlog, reuse_address=True)


class _Throttle:
    """The event loop's exception handler, with repeats of one message logged once per interval
    (seen: asyncio logs every failed accept, ~300 MB in 15 s under a descriptor flood)."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.last: dict[str, tuple[float, int]] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        key = str(context.get("message")) + type(context.get("exception")).__name__
        now = loop.time()
        last, skipped = self.last.get(key, (-self.interval, 0))
        if now - last < self.interval:
            self.last[key] = (last, skipped + 1)
            return
        self.last[key] = (now, 0)
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
                 max_connections: int) -> web.AppRunner:
    """Serve ``app`` on ``host:port``; ``runner.cleanup()`` stops accepting, then drains."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=drain_timeout, keepalive_timeout=KEEPALIVE_TIMEOUT)
    await runner.setup()
    try:
        await _CappedSite(runner, host, port, max_connections=max_connections).start()
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
