"""Maps with a bound on what they remember: the oldest entry is forgotten first. Pure."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(d: dict[K, V], key: K, value: V, cap: int) -> None:
    """``d[key] = value`` as the most recent entry; past ``cap`` entries the oldest are forgotten
    (a peer able to name new keys at will cannot grow ``d`` without bound)."""
    d.pop(key, None)
    d[key] = value
    for old in list(d)[:max(0, len(d) - cap)]:
        del d[old]
