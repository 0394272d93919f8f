"""What the router reads back from an engine's answer, without parsing the answer.

The answer's bytes go to the client as they arrive (:mod:`llmgw.router.proxy`); a request that
wants something from them (llama.cpp's prompt-cache timings here) gets its end handed over once
it is complete: the whole body, or the last few chunks of a stream, where engines put their
totals. Only those bytes are searched, and only for engines known to write what is looked for,
so the request path of every other answer pays nothing. Pure; nothing here does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TAIL_CHUNKS = 4  # the last chunks of a stream kept for reading: the totals are in the last event

# Keys, not string values: a value is followed by , } or ], never by a colon, and a quote inside
# generated text is escaped, so the model cannot write something these match.
_TIMINGS = re.compile(rb'"timings"\s*:\s*\{')
_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d{1,12})')
_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d{1,12})')
_PREDICTED_N = re.compile(rb'"predicted_n"\s*:\s*(\d{1,12})')


def last_object(tail: bytes, key: re.Pattern[bytes]) -> bytes | None:
    """The last ``"key": {...}`` of ``tail``, up to its first closing brace (the engines' totals
    objects are flat), or None. The last one: a stream's final event carries the totals."""
    found = None
    for match in key.finditer(tail):
        found = match
    if found is None:
        return None
    end = tail.find(b"}", found.end())
    return tail[found.start():] if end < 0 else tail[found.start():end]


@dataclass(frozen=True, slots=True)
class LlamaTimings:
    """llama.cpp's ``timings``: prompt tokens reused from its cache and computed, tokens predicted."""

    cached: int
    computed: int
    predicted: int

    @property
    def prompt(self) -> int:
        return self.cached + self.computed


def llama_timings(tail: bytes) -> LlamaTimings | None:
    """The last ``timings`` of a llama.cpp answer's end, or None. Exact counts, in every answer
    without asking (asked for a usage event, llama.cpp moves them into it)."""
    part = last_object(tail, _TIMINGS)
    if part is None:
        return None
    cached, computed, predicted = _CACHE_N.search(part), _PROMPT_N.search(part), _PREDICTED_N.search(part)
    if cached is None or computed is None:
        return None
    return LlamaTimings(int(cached.group(1)), int(computed.group(1)), int(predicted.group(1)) if predicted else 0)
