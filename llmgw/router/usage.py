"""Token usage per API key and model, from what the engines report (issue 18, first part).

Where the numbers come from, per kind of answer:

- **Whole answers**: the engine's ``usage`` object (``prompt_tokens``, ``completion_tokens``).
- **Streams**: the router asks the engine for a usage event (``stream_options.include_usage``,
  which vLLM, SGLang, llama.cpp's server and the simulator honour) and reads it from the
  stream's end; when the client did not ask for it, that event is taken out of the stream, so
  the client sees exactly what it asked for.
- **Streams that end early** (the client left, the engine failed or ended the body before
  ``data: [DONE]``, or an engine sent no usage event): completion tokens are the stream's
  content events, one token each as these engines stream, and prompt tokens are unknown
  (counted as 0, the request marked as counted from the stream). What was produced is
  counted; what the engine would have reported is not invented.

Pure: bytes in, numbers out. What the figures are counted against, and the outbox that keeps
them until the controller has them, are :mod:`llmgw.tenancy.usage`.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from llmgw import jsonbody
from llmgw.router.answer import last_object

_USAGE = b'"usage"'
# The key, not a string value "usage" (a value is followed by , } or ], never by a colon).
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,12})')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,12})')


def reported_usage(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the last ``usage`` object in ``tail``, or None.

    The search starts at the last ``"usage"`` key, which an engine writes after the content:
    text the model generated cannot fake it, because inside a JSON string its quotes are escaped.
    """
    part = last_object(tail, _USAGE_KEY)
    if part is None:
        return None
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
    options = body.get("stream_options")
    return with_field(raw, body, "stream_options", {**(options if type(options) is dict else {}),
                                                    "include_usage": True})


def with_field(raw: bytes, body: dict[str, Any], name: str, value: Any) -> bytes:
    """``raw`` with the top-level ``name`` set to ``value``: written in after the opening brace
    when the body has no such field (the rest byte for byte), else the body written again."""
    if name not in body and f'"{name}"'.encode() not in raw:
        i = raw.find(b"{")
        if i >= 0 and not raw[:i].strip(b" \t\r\n\xef\xbb\xbf"):  # UTF-8 (a BOM at most) before the brace
            return raw[:i + 1] + json.dumps({name: value}, separators=(",", ":")).encode()[1:-1] + b"," + raw[i + 1:]
    return jsonbody.dumps({**body, name: value})  # a big body's unread parts (RawJSON) as they came


def with_fields(raw: bytes, body: dict[str, Any], fields: dict[str, Any]) -> bytes:
    """``raw`` with each of the top-level ``fields`` set (one: as :func:`with_field` does).

    On every limited request (each completion-limit field set to what was reserved): the usual
    body already names one of them with that very number, so the others are written in after the
    opening brace and the rest goes byte for byte, as written out again it cost a limited request
    a sixth of the router's rate. Only where no engine could read the body otherwise: a field the
    body has holds exactly the value and appears once, with no escape that could spell it again
    (a parser that keeps the first of two keys would read another value)."""
    if len(fields) == 1:
        (name, value), = fields.items()
        return with_field(raw, body, name, value)
    # One pass, no generators or encoder: this runs on every limited request.
    if b"\\u" not in raw:
        added = []
        for n, v in fields.items():
            q = _quoted(n)
            if n in body:
                if type(body[n]) is not int or body[n] != v or raw.count(q) != 1:
                    break
            elif q in raw:
                break
            else:
                added.append(q + (b":%d," % v if type(v) is int else b":" + _compact(v) + b","))
        else:
            if not added:
                return raw
            i = raw.find(b"{")
            if i >= 0 and not raw[:i].strip(b" \t\r\n\xef\xbb\xbf"):  # UTF-8 (a BOM at most) before the brace
                return raw[:i + 1] + b"".join(added) + raw[i + 1:]
    return jsonbody.dumps({**body, **fields})


@functools.lru_cache(maxsize=64)
def _quoted(name: str) -> bytes:
    """``name`` as a JSON string (the router's own field names: a handful)."""
    return _compact(name)


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def strip_usage_events(chunk: bytes) -> bytes:
    """``chunk`` without the whole usage-only events (``"choices":[]`` and a ``usage``) the
    router asked for on the client's behalf, each with its blank line. Only events complete in
    this chunk are taken out; a part of one (split over reads) is passed on untouched, so the
    stream stays well-formed whatever the boundaries (the SDKs accept that chunk)."""
    if _USAGE not in chunk:
        return chunk
    parts = chunk.split(b"\n\n")
    # parts[-1] is what follows the last blank line: the start of an event not complete here.
    # parts[0] may be the end of an event begun in the last chunk: only an event that starts
    # here ("data:", after the newlines that close the one before) is taken out.
    out, dropped = [], False
    for e in parts[:-1]:
        body = e.lstrip(b"\r\n")
        if body.startswith(b"data:") and _USAGE_KEY.search(body) and b'"choices":[]' in body.replace(b" ", b""):
            out.append(e[:len(e) - len(body)])  # the newlines that belong to the event before
            dropped = True
        else:
            out.append(e + b"\n\n")
    return b"".join(out) + parts[-1] if dropped else chunk


# A non-empty string (the role chunk's "" is not a token) of what a model generates: text,
# reasoning (vLLM's and DeepSeek's reasoning_content, newer vLLM's reasoning) and a tool call's
# arguments. Inside generated text these names are escaped (\"content\"): text cannot fake one.
_CONTENT = re.compile(rb'"(?:content|text|reasoning_content|reasoning|arguments)"\s*:\s*"[^"]')


def content_events(chunk: bytes) -> int:
    """Content-bearing stream events in ``chunk`` (one token each, as the engines stream)."""
    return len(_CONTENT.findall(chunk))
