"""Package exports resolved on first use.

The router, the reconciler and gitops list what they export in their ``__init__``, but importing
a package must not import all of it: `llmgw validate` would pay for aiohttp to print its help, and
the pure decision (and the plan and state built on it) would load the reconciler's I/O.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) when ``name`` is used."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
