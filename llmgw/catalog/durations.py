"""Durations as operators write them: ``90s``, ``15m``, ``1h30m``, ``250ms``, ``7d``."""

from __future__ import annotations

import re

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_ORDER = ["d", "h", "m", "s", "ms"]
_PART = re.compile(r"(\d+)(ms|s|m|h|d)")
# No real duration needs more digits; 400 nines of days overflowed float() (review 3).
_MAX_DIGITS = 12


class DurationError(ValueError):
    """The text is not a duration; the message says why."""


def parse_duration(text: str) -> float:
    """Seconds in ``text``; units must run from largest to smallest, each at most once.

    "30m1h" is refused rather than read as 90 minutes: an out-of-order duration is far
    more often a typo than an intention.
    """
    if not isinstance(text, str) or not text:
        raise DurationError("a duration must be a string such as 90s, 15m or 1h30m")
    if len(text) > 40:
        raise DurationError(f'"{text[:40]}..." is too long for a duration such as 90s, 15m or 1h30m')
    pos = 0
    last = -1
    total = 0.0
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        if len(match.group(1)) > _MAX_DIGITS:
            raise DurationError(f'"{text}": a duration has at most {_MAX_DIGITS} digits per unit')
        unit = match.group(2)
        rank = _ORDER.index(unit)
        if rank <= last:
            raise DurationError(
                f'"{text}": units must go from largest to smallest, each once (e.g. 1h30m)'
            )
        last = rank
        total += int(match.group(1)) * _UNITS[unit]
        pos = match.end()
    if pos != len(text) or pos == 0:
        raise DurationError(f'"{text}" is not a duration such as 90s, 15m or 1h30m')
    return total


def format_duration(seconds: float) -> str:
    """The shortest text that parse_duration reads back as ``seconds`` (whole ms)."""
    ms = round(seconds * 1000)
    if ms == 0:
        return "0s"
    parts = []
    for unit in _ORDER:
        size = round(_UNITS[unit] * 1000)
        count, ms = divmod(ms, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
