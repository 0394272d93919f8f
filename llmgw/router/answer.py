"""What the router reads back from an engine's answer, without parsing the answer.

The answer's bytes go to the client as they arrive (:mod:`llmgw.router.proxy`); a request that
wants something from them (llama.cpp's prompt-cache timings here) gets its end handed over once
it is complete: the whole body, or the last few chunks of a stream, where engines put their
totals. Only those bytes are searched, and only for engines known to write what is looked for,
so the request path of every other answer pays nothing. Pure; nothing here does I/O.
"""

from __future__ import annotations

import re

TAIL_CHUNKS = 4  # the last chunks of a stream kept for reading: the totals are in the last event

_TIMINGS = b'"timings"'
_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d{1,12})')
_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d{1,12})')
_PREDICTED_N = re.compile(rb'"predicted_n"\s*:\s*(\d{1,12})')


def llama_usage(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from llama.cpp's ``timings``: the prompt is what it computed
    plus what it reused, the completion what it predicted. Exact, and in every answer's last event
    without asking, where asking for a usage event would move the timings into it."""
    i = tail.rfind(_TIMINGS)
    if i < 0:
        return None
    end = tail.find(b"}", i)
    part = tail[i:] if end < 0 else tail[i:end]
    cached, computed, predicted = _CACHE_N.search(part), _PROMPT_N.search(part), _PREDICTED_N.search(part)
    if cached is None or computed is None or predicted is None:
        return None
    return int(cached.group(1)) + int(computed.group(1)), int(predicted.group(1))


def llama_prompt_cache(tail: bytes) -> tuple[int, int] | None:
    """(prompt tokens, of which served from the engine's cache) from llama.cpp's ``timings``
    (``prompt_n`` counts the tokens it computed, ``cache_n`` those it reused), or None.

    The last ``timings`` object of ``tail`` is read: a stream's final event carries the totals.
    """
    i = tail.rfind(_TIMINGS)
    if i < 0:
        return None
    end = tail.find(b"}", i)
    part = tail[i:] if end < 0 else tail[i:end]
    cached, computed = _CACHE_N.search(part), _PROMPT_N.search(part)
    if cached is None or computed is None:
        return None
    hit, miss = int(cached.group(1)), int(computed.group(1))
    return hit + miss, hit
