"""`llmgw rollout status MODEL` says who measured the current step (issue 41): the canary requests
of the window so far by router, most first, so an operator sees when one router is most of the
evidence. Rendered into a rich Console, as the command prints it."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from llmgw.cli.rollout import _detail


def detail(window: dict[str, Any] | None) -> str:
    r = {"model": "chat", "phase": "canary", "strategy": "canary", "revision": "b" * 40, "started_at": 0.0,
         "steps": [10.0, 50.0], "step": 0, "interval": 60.0, "percent": 10.0, "canary": "chat-g3",
         "stable": "aaa", "target": "bbb", "serving_version": "aaa", "reason": "", "analysis": None,
         "history": [], "window": window}
    out = io.StringIO()
    _detail(Console(file=out, width=300, color_system=None, highlight=False), r)
    return out.getvalue()


def test_the_window_names_the_routers_its_canary_requests_came_from() -> None:
    text = detail({"since": 2.0, "canary_requests": 800, "stable_requests": 7200, "routers_not_shown": 2,
                   "routers": [{"router": "edge-2", "canary_requests": 600, "stable_requests": 6000, "processes": 4},
                               {"router": "[b]3f9c", "canary_requests": 190, "stable_requests": 1100,
                                "processes": 1}]})
    assert ("  this step so far: 800 canary and 7200 stable requests; canary requests by router: edge-2 600 "
            "(75 %, 4 processes), [b]3f9c 190 (24 %) and 2 more\n") in text  # a router's id is text, never markup
    assert text.index("this step so far") < text.index("last analysis")


def test_no_window_no_line() -> None:
    assert "this step so far" not in detail(None)
    assert "this step so far: 0 canary and 0 stable requests\n" in detail(
        {"since": 2.0, "canary_requests": 0, "stable_requests": 0, "routers_not_shown": 0, "routers": []})
