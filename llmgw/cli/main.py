"""The `llmgw` command: one entry point, one subcommand module per verb."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from rich.console import Console

from llmgw import __version__
from llmgw.cli import diff, fleet, serve, up, validate
from llmgw.cli.output import make_console


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw", description="GitOps control plane for self-hosted LLM inference"
    )
    parser.add_argument("--version", action="version", version=f"llmgw {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    validate.add_parser(sub)
    fleet.add_parsers(sub)
    diff.add_parser(sub)
    serve.add_parsers(sub)
    up.add_parser(sub)
    from llmgw.router import main as router_cmd

    router_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, console: Console | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args, console or make_console()))
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handling
        return 130
    except BrokenPipeError:
        # The reader left (`llmgw events -o json | head -1`): done, quietly, as `git log | head` is.
        # stdout onto /dev/null: the flush at exit would otherwise raise the same error again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
