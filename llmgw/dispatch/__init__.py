"""Carrying the reconciler's decisions to the nodes' agents (DESIGN §4).

``Dispatcher`` is the protocol; ``SshDispatcher`` (paramiko, one persistent connection and one
long-lived agent per node) and ``LocalDispatcher`` (the agent as a subprocess) implement it, and
``RecordingDispatcher`` is the in-memory fake for tests and ``llmgw diff``. The transports are
imported on first use, so code that only needs the protocol or the fake does not load paramiko.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmgw.dispatch.base import Dispatcher, HelloAnswer, NodeTarget, StartRequest
from llmgw.dispatch.recording import Call, FakeNode, RecordingDispatcher

if TYPE_CHECKING:
    from llmgw.dispatch.local import LocalDispatcher
    from llmgw.dispatch.ssh import NodeStats, SshDispatcher

__all__ = [
    "Call",
    "Dispatcher",
    "FakeNode",
    "HelloAnswer",
    "LocalDispatcher",
    "NodeStats",
    "NodeTarget",
    "RecordingDispatcher",
    "SshDispatcher",
    "StartRequest",
]

_LAZY = {
    "SshDispatcher": "llmgw.dispatch.ssh",
    "NodeStats": "llmgw.dispatch.ssh",
    "LocalDispatcher": "llmgw.dispatch.local",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
