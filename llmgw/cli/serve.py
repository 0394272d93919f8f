"""`llmgw controller` and `llmgw node trust`: running the control plane, trusting a node."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.console import Console

from llmgw.cli.fleet import _run, common, takeover
from llmgw.cli.output import fail
from llmgw.errors import ConfigError, DispatchError, LlmgwError
from llmgw.serving import STOP_SIGNALS


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("controller", help="run the controller, the router and the admin API from a config file")
    p.add_argument("--config", required=True, help="the controller's YAML config (see README: a real fleet)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_controller)

    node = sub.add_parser("node", help="node helpers")
    nsub = node.add_subparsers(dest="node_action", required=True)
    t = nsub.add_parser("trust", help="show a node's SSH host key fingerprint and record it in known_hosts")
    t.add_argument("address", help="HOST or HOST:PORT")
    t.add_argument("--known-hosts", required=True, help="the known_hosts file the controller uses")
    t.add_argument("--replace", action="store_true", help="replace a recorded key that changed")
    t.add_argument("--fingerprint", help="record the key only if the node presents this one (SHA256:..., as "
                                         "ssh-keygen -lf prints it on the node)")
    t.add_argument("--yes", action="store_true", help="record the key presented without comparing it")
    t.add_argument("--timeout", type=float, default=10.0)
    t.set_defaults(func=trust_node)
    k = nsub.add_parser("takeover", parents=[common()],
                        help="make this controller the one that drives a node (fencing: the other is refused)")
    k.add_argument("node")
    k.add_argument("--stop-foreign", action="store_true",
                   help="also stop the engines the other controller started there (else they keep running)")
    k.set_defaults(func=_run(takeover))


COMPARE = "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub"


def trust_node(args: argparse.Namespace, console: Console) -> int:
    """The fingerprint first, the key recorded after: only with the fingerprint the operator read
    on the node (--fingerprint), a yes at a terminal, or --yes (seen: the key was recorded before
    the operator was told to compare it)."""
    from llmgw.dispatch.trust import fetch_host_key, trust

    host, sep, port = args.address.rpartition(":")
    if not sep or not port.isdigit():
        host, port = args.address, "22"
    host = host.strip("[]")
    expect = args.fingerprint
    try:
        if expect is None and not args.yes:
            key = fetch_host_key(host, int(port), timeout=args.timeout)
            console.print(f"{host}:{port} {key.key_type} {key.fingerprint}", markup=False, highlight=False)
            if not _is_tty() or not _confirm(console, f"Is this the fingerprint `{COMPARE}` prints on the node?"):
                console.print(f"not recorded. Compare it with the node's own ({COMPARE}), then: llmgw node trust "
                              f"{args.address} --known-hosts {args.known_hosts} --fingerprint {key.fingerprint}",
                              markup=False, highlight=False, soft_wrap=True)
                return 2
            expect = key.fingerprint
        key = trust(host, int(port), Path(args.known_hosts), replace=args.replace, timeout=args.timeout,
                    expect=expect)
    except (DispatchError, OSError) as exc:
        return fail(console, str(exc))
    console.print(f"{host}:{port} {key.key_type} {key.fingerprint}", markup=False, highlight=False)
    console.print(f"recorded in {args.known_hosts}", markup=False, highlight=False)
    return 0


def _is_tty() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _confirm(console: Console, question: str) -> bool:
    try:
        return console.input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


def run_controller(args: argparse.Namespace, console: Console) -> int:
    from llmgw.compose.server import serve_forever
    from llmgw.control.config import load_config
    from llmgw.control.datadir import hold_data_dir
    from llmgw.redact import redact, redact_logs
    from llmgw.stdio import guard

    guard()  # before logging, whose handler keeps the stream it is given
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact_logs()  # a URL's credential (the repository's, git's stderr) never reaches a log line
    try:
        cfg = load_config(args.config)
        hold_data_dir(cfg.controller.data_dir)  # before anything else: one process per data dir
    except ConfigError as exc:
        return fail(console, str(exc))

    def ready(running) -> None:  # noqa: ANN001 - server.Running
        console.print(f"llmgw controller following {redact(cfg.controller.repo)} ({cfg.controller.branch})")
        console.print(f"  router:    {running.router_url}/v1")
        console.print(f"  admin API: {running.admin_url}/api/v1  dashboard: {running.admin_url}/")

    return run_until_signal(lambda stop: serve_forever(cfg, stop=stop, on_ready=ready), console)


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]], console: Console) -> int:
    """Run ``main(stop)``: the first SIGINT, SIGTERM or SIGHUP sets ``stop``, and ``main`` shuts down
    in its own time. Later signals are noted, not obeyed: a second Ctrl-C, or the HUP a shell passes
    on when its terminal closes, once cancelled `up`'s shutdown half-way and left its engines
    running. A signal while ``main`` is still starting is kept until it waits for one. Errors as
    messages, not tracebacks."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                console.print(f"{sig.name}: already stopping, engines included; it ends by itself "
                              "(SIGKILL would leave engines running)", style="dim")
            stop.set()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        await main(stop)

    try:
        asyncio.run(runner())
    except LlmgwError as exc:
        return fail(console, str(exc))
    return 0
