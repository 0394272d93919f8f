"""Shared output helpers: every command prints through a Console it is given.

Passing the Console in (rather than a module-global one) is what lets tests render a
command into a StringIO and compare the text a person would see.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypedDict

from rich.console import Console


def make_console(*, stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_json(console: Console, data: Any) -> None:
    """JSON for machines: plain text, no markup, no wrapping, one document."""
    console.file.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    console.file.flush()


def fail(console: Console, message: str, *, code: int = 1) -> int:
    console.print(f"[bold red]error:[/] {_escape(message)}")
    return code


class Confinement(TypedDict, total=False):
    """How a node's agent runs engines, as GET /api/v1/nodes reports it (null: not reported yet)."""

    user: str
    sandbox: Literal["bwrap", "none"]
    detail: str
    problem: str | None  # set: the node refuses every start, for this reason


def confinement_label(c: Confinement | None) -> str:
    """One short phrase for a node's confinement; `llmgw nodes` and the dashboard both show it.

    Ends in ``root!`` whenever engines run as root, so a glance down the column finds them;
    a node that has not reported it (absent, null, no user) reads ``unknown``, never a guess.
    """
    if not isinstance(c, dict) or not isinstance(c.get("user"), str) or not c["user"]:
        return "unknown"
    user, sandbox = c["user"], c.get("sandbox")
    who = "root!" if user == "root" else user
    if isinstance(sandbox, str) and sandbox and sandbox != "none":
        return f"{sandbox} as {who}"  # bwrap today; a sandbox added later shows by its name
    return "root!" if user == "root" else f"user {user}"


def node_problems(n: dict[str, Any]) -> list[str]:
    """What is wrong with a node, for the problems column of `llmgw nodes` and the dashboard."""
    conf = n.get("confinement")
    refused = conf.get("problem") if isinstance(conf, dict) else None
    return [*n["unhealthy_gpus"], *([n["error"]] if n["error"] else []),
            *([f"refuses starts: {refused}"] if refused else [])]


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)

