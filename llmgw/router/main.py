"""`llmgw router`: the router as its own process, following a controller.

As many of these as a load balancer needs can run beside (or far from) the controller; each
serves from the last snapshot it received while the controller is away::

    LLMGW_ADMIN_TOKEN=… llmgw router --url http://ctl:9090 --listen 0.0.0.0:8000 --api-keys keys.yaml

The controller is named as in every other command (`llmgw.adminaccess`): ``--url`` with
``--token`` or ``$LLMGW_ADMIN_TOKEN`` (which keeps it out of `ps`; it is never logged),
``--data-dir`` of a local `llmgw up`, or ``LLMGW_ADMIN_URL`` with ``LLMGW_ADMIN_TOKEN``;
``--controller`` and ``--admin-token`` are the older spellings. Several controllers sharing one
store (one leads, the others stand by) are all named, ``--url http://ctl-a:9090,http://ctl-b:9090``
or ``--url`` repeated, and the router follows whichever leads (`llmgw.router.leader`). The process
stops on SIGTERM/SIGINT, giving requests in flight ``--drain-timeout`` seconds to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmgw.adminaccess import add_options, resolve_each
from llmgw.errors import AccessError, ConfigError
from llmgw.router.config import RouterConfig  # a dataclass only: cheap for the CLI to import
from llmgw.serving import STOP_SIGNALS, listen, raise_fd_limit, throttle_loop_errors

if TYPE_CHECKING:
    from llmgw.router.keys import KeyRing

log = logging.getLogger("llmgw.router")

LIMITS_REDIS_ENV = "LLMGW_LIMITS_REDIS"  # an environment variable keeps a password out of `ps`


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `llmgw router` (shared by the `llmgw` CLI and ``python -m llmgw.router.main``)."""
    d = RouterConfig()
    add_options(p, url_aliases=("--controller",), token_aliases=("--admin-token",), several=True)
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="client listener")
    p.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                   help="serve /metrics with usage per tenant and API key here, to bearers of the admin token "
                        "(the client listener's /metrics has no tenant or key names)")
    p.add_argument("--parse-workers", type=int, default=d.parse_workers,
                   help="processes parsing big request bodies off the event loop (0: all on it)")
    p.add_argument("--api-keys", metavar="FILE", default=None,
                   help="YAML/JSON list of {name, sha256, models}; without it the router checks the keys the "
                        "controller sends, and is open when the controller has none")
    p.add_argument("--router-id", default=None, help="name in the controller's reports (default: host-pid-rand)")
    p.add_argument("--hold-timeout", type=float, default=d.hold_timeout,
                   help="seconds a request waits for a replica to be woken")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout)
    p.add_argument("--first-byte-timeout", type=float, default=d.first_byte_timeout)
    p.add_argument("--body-limit", type=int, default=d.body_limit, help="largest request body, bytes")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    p.add_argument("--report-interval", type=float, default=2.0, help="seconds between usage reports")
    p.add_argument("--reconnect-max", type=float, default=10.0,
                   help="longest wait, seconds, between rounds of attempts to reach a controller (while one "
                        "answers as a standby, at most 1)")
    p.add_argument("--limits-redis", default=None, metavar="URL",
                   help=f"Redis shared by every router for tenants' limits, redis://[:password@]host:port/db "
                        f"(default: ${LIMITS_REDIS_ENV}; none: this router counts on its own)")
    p.add_argument("--log-level", default="INFO")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmgw router", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `router` on the `llmgw` CLI's subparsers (``args.func(args, console)`` convention)."""
    p = sub.add_parser("router", help="run a router that follows a controller")
    add_arguments(p)
    p.set_defaults(func=run)


def parse_listen(value: str, *, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{flag} {value!r}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def run(args: argparse.Namespace, console: Any = None) -> int:  # noqa: ARG001 - CLI convention
    from llmgw.stdio import guard

    guard()  # a full or closed pipe must not block or abort the router (llmgw.stdio); before logging
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from llmgw.router.keys import KeyRing

    try:
        accesses = resolve_each(args.url, args.token, args.data_dir)
        host, port = parse_listen(args.listen)
        metrics_at = parse_listen(args.metrics_listen, flag="--metrics-listen") if args.metrics_listen else None
        keys = KeyRing.load(args.api_keys) if args.api_keys else KeyRing()
    except (AccessError, ConfigError) as exc:
        print(f"llmgw router: {exc}", file=sys.stderr)
        return 2
    raise_fd_limit()
    config = RouterConfig(hold_timeout=args.hold_timeout, connect_timeout=args.connect_timeout,
                          first_byte_timeout=args.first_byte_timeout, body_limit=args.body_limit,
                          drain_timeout=args.drain_timeout, parse_workers=max(0, args.parse_workers),
                          limits_redis=args.limits_redis or os.environ.get(LIMITS_REDIS_ENV, ""))
    try:
        _run(_serve(args, [a.url for a in accesses], accesses[0].token, host, port, keys, config,
                    metrics_at=metrics_at))
    except OSError as exc:
        print(f"llmgw router: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(args: argparse.Namespace, controllers: list[str], token: str, host: str, port: int,
                 keys: KeyRing, config: RouterConfig, *, metrics_at: tuple[str, int] | None = None) -> None:
    """Serve until a stop signal, following the leader of ``controllers`` (all given ``token``)."""
    from llmgw.router.app import Router
    from llmgw.router.follow import FeedClient

    router = Router(keys=keys, config=config)
    listening: list[int] = []  # the bound port, once bound (a snapshot may come first)
    said: list[tuple[bool, int]] = []

    def controller_keys(ring: KeyRing) -> None:
        """Say which keys the router enforces when the controller's change (not on every snapshot)."""
        if said and said[-1] == (ring.open, len(ring.keys)):
            return
        said.append((ring.open, len(ring.keys)))
        _say_keys(ring, f"from the controller at {feed.controller}", host=host,
                  port=listening[0] if listening else port)

    feed = FeedClient(router, controllers, token, router_id=args.router_id,
                      report_interval=args.report_interval, backoff_max=args.reconnect_max,
                      follow_keys=not args.api_keys, on_keys=controller_keys)
    router.wake = feed.report_soon
    stop = asyncio.Event()
    throttle_loop_errors()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    await router.start()
    metrics = None
    try:
        bound = await router.listen(host, port)
        listening.append(bound)
        if metrics_at is not None:
            metrics = await listen(router.metrics_app(token), *metrics_at, drain_timeout=1.0,
                                   max_connections=64, openai_errors=False)
            log.info("metrics with tenant and key names on http://%s:%d/metrics (admin token required)",
                     *metrics_at)
        await feed.start()
        # Without --api-keys the router enforces the controller's keys, which come with its first
        # snapshot: this line had said "open: no API keys" while the router enforced them.
        log.info("router %s listening on http://%s:%d, following %s (API keys: %s)", feed.router_id, host, bound,
                 controllers[0] if len(controllers) == 1 else f"the leader of {', '.join(feed.controllers)}",
                 f"from {args.api_keys}" if args.api_keys else "the controller's, with its first snapshot")
        if args.api_keys:
            _say_keys(keys, f"from {args.api_keys}", host=host, port=bound)
        await stop.wait()
        log.info("stopping: %d requests in flight get %.0f s", router.requests_in_flight(), config.drain_timeout)
    finally:
        if metrics is not None:
            await metrics.cleanup()
        await router.drain()  # first: the last answers' usage goes out with the feed's last report
        await feed.close()
        await router.close()


def _say_keys(ring: KeyRing, source: str, *, host: str, port: int) -> None:
    """Log the keys the router enforces, and warn when it is open on an address others reach."""
    from llmgw.router.exposure import open_warning

    warning = open_warning(keys_open=ring.open, host=host, port=port)
    if warning is not None:
        log.warning("%s (no API keys %s)", warning, source)
    elif ring.open:
        log.info("no API keys %s: open, on a loopback address only", source)
    else:
        log.info("%d API key%s %s", len(ring.keys), "" if len(ring.keys) == 1 else "s", source)


def _run(coro: Any) -> None:
    """uvloop when installed (a faster event loop for a process that is all I/O), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
