"""Shared output helpers: every command prints through a Console it is given.

Passing the Console in (rather than a module-global one) is what lets tests render a
command into a StringIO and compare the text a person would see.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console


def make_console(*, stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_json(console: Console, data: Any) -> None:
    """JSON for machines: plain text, no markup, no wrapping, one document."""
    console.file.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    console.file.flush()


def fail(console: Console, message: str, *, code: int = 1) -> int:
    """``error: message`` on stderr (a console on the process's stdout is swapped for one on
    stderr: `llmgw nodes -o json > f` must not write the error into f); ``code``."""
    if console.file is sys.stdout:
        console = make_console(stderr=True)
    console.print(f"[bold red]error:[/] {_escape(message)}")
    return code


def _escape(text: str) -> str:
    from rich.markup import escape

    from llmgw.safetext import visible

    # A message quotes what it is about (a file name, a catalog key, a server's answer): shown as
    # text, never as rich markup nor as terminal escapes.
    return escape(visible(text))

