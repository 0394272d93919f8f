"""How a node is described in words, from the admin API's node objects (GET /api/v1/nodes).

Pure, and importing nothing: both `llmgw nodes` (a client of the API) and the dashboard (served
by it) use these, so the two never describe a node differently.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict


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
    gpus = n.get("gpu_disagreement")  # absent from a controller older than the comparison
    return [*n["unhealthy_gpus"], *([n["error"]] if n["error"] else []),
            *([f"refuses starts: {refused}"] if refused else []),
            *([f"GPUs: {gpus} (placement counts the agent's)"] if gpus else []),
            *(f"draining: {w}" for w in n.get("drain_waits") or ())]
