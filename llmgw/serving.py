"""One way to serve HTTP, used by every listener of every llmgw process (DESIGN §6).

The router, the admin API and the dashboard, in `llmgw controller`, `llmgw up` and `llmgw
router` alike, listen through :func:`listen`: a client that goes away cancels its handler (and
so the engine's work), shutdown lets in-flight requests finish for a bounded time, the backlog
is deep enough for a burst, and idle keep-alive connections are closed. A separate wiring per
process is how `up` once kept an engine busy for a client that had left.
"""

from __future__ import annotations

import signal

from aiohttp import web

# A closed terminal (HUP) stops a process as INT and TERM do: `up` under a terminal that goes
# away must not leave its engines behind.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BACKLOG = 1024
# Idle keep-alive connections are closed after this: each one holds a descriptor.
KEEPALIVE_TIMEOUT = 15.0


async def listen(app: web.Application, host: str, port: int, *, drain_timeout: float) -> web.AppRunner:
    """Serve ``app`` on ``host:port``; ``runner.cleanup()`` stops accepting, then drains."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=drain_timeout, keepalive_timeout=KEEPALIVE_TIMEOUT)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True, backlog=BACKLOG).start()
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
