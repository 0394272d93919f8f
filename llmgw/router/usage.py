"""Token usage per API key and model, from what the engines report (issue 18, first part; issue 35).

Where the numbers come from, per kind of answer:

- **Whole answers**: the engine's ``usage`` object (``prompt_tokens``, ``completion_tokens``).
- **Streams**: the engine's own counts, asked for on the client's behalf (:func:`relay_stream`).
  vLLM, SGLang and the simulator are asked for a usage event at the end and a running count in
  every event (``stream_options.include_usage`` and ``continuous_usage_stats``); llama.cpp's
  server for its ``timings`` in every event (``timings_per_token``; its last event carries them
  unasked, and asked for a usage event it would move them out of the event a client reads). What
  the client did not ask for is taken out again on the way back (:class:`Relay`), so it sees
  exactly what it asked for. A stream read to its end is counted from its last report.
- **Streams that end early** (the client left, the engine died or ended the body before ``data:
  [DONE]``): the engine's running count in the last event written to the client (:class:`Meter`):
  the prompt as the engine read it, the completion tokens it had generated for the text the
  client was handed. One event may carry several tokens (engines merge them: an incomplete UTF-8
  character, text held while it may start a stop string; the simulator writes 1 to 3), so the
  events themselves are not a count; only an engine that reports nothing as it goes is counted
  from them, one token per content event, a floor (the request marked as counted from the stream).

What "equal to the engine's counters" means for a cut stream, read off llama.cpp's server
(tools/server/server-context.cpp, the version scripts/build-llama-server builds): prompt tokens go
into ``llamacpp:prompt_tokens_total`` (computed) and ``prompt_tokens_cached_total`` (reused) as the
prompt is processed, before the first token, cancelled or not: the ledger's prompt tokens equal
their sum for every request that produced a token. Generated tokens go into
``tokens_predicted_total`` when the slot is released (``callback_on_reset``:
``metrics_on_prediction`` adds the slot's ``n_gen``), at the end of a completed task and at the
cancel of an abandoned one alike, so a cancelled task counts every token it decoded before its
cancel took effect, including the ones no client got (seen here: a client that left after the
event saying 10 had 11 counted). The ledger charges what was delivered, so for a cut stream it is
at most the engine's count, the difference being what the engine made after the client's last
event; for every answer read to its end it is the engine's count exactly. An engine killed
mid-stream never counts that task's generated tokens (its counters die with it), while the client
is charged what it was handed before the break. vLLM counts generated tokens per engine step,
which likewise includes a cancelled request's tokens past the last one sent.

"What the client was handed" is what the router wrote to the client's connection: an event whose
write failed is not counted; bytes written just before a client closed may still be lost in its
socket, which the router cannot see.

Pure: bytes in, numbers out. What the figures are counted against, and the outbox that keeps
them until the controller has them, are :mod:`llmgw.tenancy.usage`.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Relay:
    """How one stream goes back to its client: what the router asked the engine for and the client
    did not, taken out of each piece by ``strip`` (None: nothing to take out), and where the
    engine's running count is (llama.cpp's ``timings``, else a ``usage`` object), per answer when
    the request asked for ``choices`` of them."""

    strip: Callable[[bytes], bytes] | None
    timings: bool = False
    choices: int = 1


def relay_stream(raw: bytes, body: dict[str, Any], *, timings: bool) -> tuple[bytes, Relay]:
    """``raw`` asking the engine for its running counts (``timings``: llama.cpp's way), and how
    to relay the stream: what the client did not ask for comes out again.

    The common case, a body without the field, gets it written in after the opening brace (the
    rest byte for byte, as the model rewrite does); a body that says something else of it is
    written again from its parsed form.
    """
    n = body.get("n")
    choices = n if type(n) is int and n > 1 else 1
    if timings:
        if body.get("timings_per_token") is True:
            return raw, Relay(None, True, choices)
        return (with_field(raw, body, "timings_per_token", True, written=_TIMINGS_PER_TOKEN),
                Relay(_without_partial_timings, True, choices))
    given = body.get("stream_options")
    options: dict[str, Any] = given if type(given) is dict else {}
    final = options.get("include_usage") is True
    if final and options.get("continuous_usage_stats") is True:
        return raw, Relay(None, False, choices)
    asked = {**options, "include_usage": True, "continuous_usage_stats": True}
    return (with_field(raw, body, "stream_options", asked, written=_RUNNING_USAGE),
            Relay(_without_running_usage if final else _without_usage, False, choices))


# The fields asked for, as written in after the opening brace of a body that has none of them.
_TIMINGS_PER_TOKEN = b'"timings_per_token":true,'
_RUNNING_USAGE = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true},'


def with_field(raw: bytes, body: dict[str, Any], name: str, value: Any, *, written: bytes | None = None) -> bytes:
    """``raw`` with the top-level ``name`` set to ``value``: written in after the opening brace
    when the body has no such field (the rest byte for byte; ``written``: the field as it is
    written there, when the caller has it at hand), else the body written again."""
    if name not in body and _quoted(name) not in raw:
        i = raw.find(b"{")
        if i >= 0 and not raw[:i].strip(b" \t\r\n\xef\xbb\xbf"):  # UTF-8 (a BOM at most) before the brace
            if written is None:
                written = json.dumps({name: value}, separators=(",", ":")).encode()[1:-1] + b","
            return raw[:i + 1] + written + raw[i + 1:]
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


def _without_running_usage(chunk: bytes) -> bytes:
    """``chunk`` without the running counts of its events (the client asked for the usage event only)."""
    return _cut_usage(chunk, events=False)


def _without_usage(chunk: bytes) -> bytes:
    """``chunk`` without the usage event or the running counts (the client asked for neither)."""
    return _cut_usage(chunk, events=True)


# A usage object (one level of objects inside it: token details), and llama.cpp's flat timings.
# Keys, not text the model wrote: inside a JSON string their quotes are escaped. Found by their
# key first (:func:`_members`): this runs on every piece of every stream.
_USAGE_MEMBER = re.compile(rb'"usage"\s*:\s*\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}')
_TIMINGS_MEMBER = re.compile(rb'"timings"\s*:\s*\{[^{}]*\}')
_TIMINGS = b'"timings"'
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')  # the usage event: the whole request's count
_NOT_FINISHED = re.compile(rb'"finish_reason"\s*:\s*null')
_WS = b" \t\r\n"


def _cut_usage(chunk: bytes, *, events: bool) -> bytes:
    """``chunk`` without the running counts of its events (vLLM, SGLang and the simulator write
    them after the choices) and, with ``events``, without its usage-only events (``"choices":[]``
    and a ``usage``), each with its blank line. Only events whole in this chunk are taken out; a
    part of one (split over reads) is passed on untouched, so the stream stays well-formed
    whatever the boundaries (the SDKs accept that piece)."""
    cuts = []
    for m in _members(chunk, _USAGE, _USAGE_MEMBER):
        start, end = _event_around(chunk, m.start())
        if _NO_CHOICES.search(chunk, start, len(chunk) if end < 0 else end):
            if events and end >= 0:
                body = start + len(chunk[start:end]) - len(chunk[start:end].lstrip(b"\r\n"))
                if chunk.startswith(b"data:", body):  # begun here: the newlines before it are the last event's
                    cuts.append((body, end))
        elif (span := _member(chunk, m.start(), m.end())) is not None:
            cuts.append(span)
    return _without(chunk, cuts)


def _without_partial_timings(chunk: bytes) -> bytes:
    """``chunk`` without the timings llama.cpp wrote because it was asked, in every event that is
    not its last (``finish_reason`` still null); the last event's stay. (One event of a stream that
    ends at a stop string has them unasked too, and loses them here.)"""
    cuts = []
    for m in _members(chunk, _TIMINGS, _TIMINGS_MEMBER):
        start, end = _event_around(chunk, m.start())
        if _NOT_FINISHED.search(chunk, start, len(chunk) if end < 0 else end) and (
                span := _member(chunk, m.start(), m.end())) is not None:
            cuts.append(span)
    return _without(chunk, cuts)


def _members(chunk: bytes, key: bytes, member: re.Pattern[bytes]) -> Iterator[re.Match[bytes]]:
    """Each ``member`` of ``chunk`` that starts with ``key`` (found by ``bytes.find``, faster than
    the regex engine's own scan, and nothing at all to do for a piece without the key)."""
    i = chunk.find(key)
    while i >= 0:
        m = member.match(chunk, i)
        if m is not None:
            yield m
            i = chunk.find(key, m.end())
        else:
            i = chunk.find(key, i + len(key))


def _event_around(chunk: bytes, at: int) -> tuple[int, int]:
    """The SSE event holding ``at``: from after the blank line before it (or the chunk's start)
    to after the blank line that ends it (-1: it does not end in this chunk). A blank line is
    LF LF, or CRLF CRLF (SSE allows either; the engines here write LF)."""
    lf, crlf = chunk.rfind(b"\n\n", 0, at), chunk.rfind(b"\n\r\n", 0, at)
    start = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
    lf, crlf = chunk.find(b"\n\n", at), chunk.find(b"\n\r\n", at)
    if lf < 0 and crlf < 0:
        return start, -1
    return start, min(lf + 2 if lf >= 0 else len(chunk) + 1, crlf + 3 if crlf >= 0 else len(chunk) + 1)


def _member(chunk: bytes, start: int, end: int) -> tuple[int, int] | None:
    """What to cut to take the object member at ``start:end`` out and keep the object valid JSON:
    the comma before it with it, or (the first member) the comma after it; None for a lone member."""
    i = start - 1
    while i >= 0 and chunk[i] in _WS:
        i -= 1
    if i >= 0 and chunk[i] == 0x2C:  # ,
        return i, end
    j = end
    while j < len(chunk) and chunk[j] in _WS:
        j += 1
    if i >= 0 and chunk[i] == 0x7B and j < len(chunk) and chunk[j] == 0x2C:  # {member, next
        j += 1
        while j < len(chunk) and chunk[j] in _WS:
            j += 1
        return start, j
    return None


def _without(chunk: bytes, cuts: list[tuple[int, int]]) -> bytes:
    if not cuts:
        return chunk
    out, at = [], 0
    for a, b in cuts:
        out.append(chunk[at:a])
        at = b
    out.append(chunk[at:])
    return b"".join(out)


def whole_events(data: bytes) -> int:
    """Where the last whole SSE event of ``data`` ends (after its blank line); 0 when none does."""
    if data.endswith(b"\n\n"):
        return len(data)
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


_TIMINGS_KEY = re.compile(rb'"timings"\s*:\s*\{')
_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d{1,12})')
_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d{1,12})')
_PREDICTED_N = re.compile(rb'"predicted_n"\s*:\s*(\d{1,12})')
_INDEX = re.compile(rb'"index"\s*:\s*(\d{1,6})')


class Meter:
    """The engine's running count of a stream, read from the events written to the client: fed
    each piece once it is written (:meth:`written`, an ``in`` when it carries no count), read at
    the end (:meth:`count`). Only whole count objects are read, so a piece that ends inside one is
    never taken for a smaller count."""

    __slots__ = ("_key", "_timings", "_last", "_before", "_each")

    def __init__(self, relay: Relay) -> None:
        self._timings = relay.timings
        self._key = _TIMINGS if relay.timings else _USAGE
        self._last = self._before = b""
        # Per answer when several were asked for: each event counts its own answer (vLLM's way).
        self._each: dict[int, tuple[int, int]] | None = {} if relay.choices > 1 else None

    def written(self, piece: bytes) -> None:
        if self._key in piece:
            if self._each is None:
                self._before, self._last = self._last, piece
            else:
                for line in piece.split(b"\n"):
                    if self._key in line and not _NO_CHOICES.search(line) and (counted := self._read(line)):
                        index = _INDEX.search(line)
                        self._each[int(index.group(1)) if index else 0] = counted

    def count(self) -> tuple[int, int] | None:
        """(prompt, completion) tokens as the engine counted them at the last event written, or
        None when no event written carried a count."""
        if self._each is None:
            return self._read(self._last) or self._read(self._before)
        if not self._each:
            return None
        return max(p for p, _ in self._each.values()), sum(c for _, c in self._each.values())

    def _read(self, piece: bytes) -> tuple[int, int] | None:
        key = _TIMINGS_KEY if self._timings else _USAGE_KEY
        for match in reversed(list(key.finditer(piece))):
            end = piece.find(b"}", match.end())
            if end < 0:
                continue  # cut inside it
            part = piece[match.end():end]
            if self._timings:
                cached, computed, made = _CACHE_N.search(part), _PROMPT_N.search(part), _PREDICTED_N.search(part)
                if cached and computed and made:
                    return int(cached.group(1)) + int(computed.group(1)), int(made.group(1))
            else:
                prompt, completion = _PROMPT.search(part), _COMPLETION.search(part)
                if prompt and completion:
                    return int(prompt.group(1)), int(completion.group(1))
        return None


# A non-empty string (the role chunk's "" is not a token) of what a model generates: text,
# reasoning (vLLM's and DeepSeek's reasoning_content, newer vLLM's reasoning) and a tool call's
# arguments. Inside generated text these names are escaped (\"content\"): text cannot fake one.
_CONTENT = re.compile(rb'"(?:content|text|reasoning_content|reasoning|arguments)"\s*:\s*"[^"]')


def content_events(chunk: bytes) -> int:
    """Content-bearing stream events in ``chunk``: a floor of the tokens in them (an event carries
    one or more), the count of a stream whose engine reports none as it goes."""
    return len(_CONTENT.findall(chunk))
