"""Token usage per API key and model, from what the engines report (issue 18, first part).

Where the numbers come from, per kind of answer:

- **Whole answers**: the engine's ``usage`` object (``prompt_tokens``, ``completion_tokens``).
- **Streams**: the router asks the engine for a usage event (``stream_options.include_usage``,
  which vLLM, SGLang, llama.cpp's server and the simulator honour) and reads it from the
  stream's end; when the client did not ask for it, that event is taken out of the stream, so
  the client sees exactly what it asked for.
- **Streams that end early** (the client left, the engine failed, or an engine sent no usage
  event): completion tokens are the stream's content events, one token each as these engines
  stream, and prompt tokens are unknown (counted as 0, the request marked as counted from the
  stream). What was produced is counted; what the engine would have reported is not invented.

Pure: bytes and numbers in, numbers out; the router owns the ledger and the I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_USAGE = b'"usage"'
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,12})')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,12})')
_INCLUDE = b'"stream_options":{"include_usage":true},'


@dataclass
class Usage:
    """One key's use of one model since the router started (mutable: the router adds to it)."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_from_stream: int = 0  # requests whose tokens were counted from the stream, not reported

    def to_json(self) -> dict[str, int]:
        return {"requests": self.requests, "errors": self.errors, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "counted_from_stream": self.counted_from_stream}


def reported_usage(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the last ``usage`` object in ``tail``, or None.

    The search starts at the last ``"usage"`` key, which an engine writes after the content:
    text the model generated cannot fake it, because inside a JSON string its quotes are escaped.
    """
    i = tail.rfind(_USAGE)
    if i < 0:
        return None
    end = tail.find(b"}", i)
    part = tail[i:] if end < 0 else tail[i:end]
    prompt, completion = _PROMPT.search(part), _COMPLETION.search(part)
    if prompt is None:
        return None
    return int(prompt.group(1)), int(completion.group(1)) if completion is not None else 0


def wants_usage(body: dict[str, Any]) -> bool:
    """Whether the client itself asked for the stream's usage event."""
    options = body.get("stream_options")
    return type(options) is dict and options.get("include_usage") is True


def ask_for_usage(raw: bytes, body: dict[str, Any]) -> bytes:
    """``raw`` asking the engine for a usage event at the end of the stream.

    The common case, a body without ``stream_options``, gets the field written in after the
    opening brace (the rest byte for byte, as the model rewrite does); a body whose options say
    something else is written again from its parsed form with ``include_usage`` set.
    """
    if wants_usage(body):
        return raw
    if "stream_options" not in body and b"stream_options" not in raw:
        i = raw.find(b"{")
        if i >= 0:
            return raw[:i + 1] + _INCLUDE + raw[i + 1:]
    options = body.get("stream_options")
    merged = {**(options if type(options) is dict else {}), "include_usage": True}
    try:
        return json.dumps({**body, "stream_options": merged}, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate: kept as its escape
        return json.dumps({**body, "stream_options": merged}, separators=(",", ":")).encode()


def strip_usage_events(chunk: bytes) -> bytes:
    """``chunk`` without the usage-only events (``"choices":[]`` and a ``usage``) the router
    asked for on the client's behalf. Events are whole in a chunk as engines write them; an
    event split over two chunks is passed on (a valid chunk the SDKs accept), never cut."""
    if _USAGE not in chunk:
        return chunk
    events = chunk.split(b"\n\n")
    kept = [e for e in events if not (_USAGE in e and b'"choices":[]' in e.replace(b" ", b""))]
    return b"\n\n".join(kept) if len(kept) != len(events) else chunk


_CONTENT = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')  # a non-empty string: the role chunk's "" is not a token


def content_events(chunk: bytes) -> int:
    """Content-bearing stream events in ``chunk`` (one token each, as the engines stream)."""
    return len(_CONTENT.findall(chunk))
