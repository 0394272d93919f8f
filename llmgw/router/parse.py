"""Reading a request body without stalling the router for every other client (issue 24).

A body is parsed on the one event loop every request shares: a 30 MB body of small messages
held it for 0.4–1.8 s, and two senders of such bodies cut another tenant's completed requests
from 1,282 to 28 in 10 s. A thread does not help: json's C parser holds the GIL for the whole
parse (measured: the loop's longest pause equals the parse time, threaded or not). So:

- **Small bodies are parsed inline**: up to :data:`SMALL_BYTES`, or up to :data:`INLINE_BYTES`
  with at most :data:`INLINE_VALUES` JSON values (counted from the separators, an upper bound).
  That is at most ~1 ms of the loop, less than handing the body to another process costs,
  and it is nearly every request (a long chat is a few hundred values).
- **Bigger ones go to a worker process**, at most ``workers`` at a time (a semaphore; waiting is
  bounded), run at a lower priority so the router and the engines come first on a busy machine.
  What comes back is only what the router reads (:class:`Summary`): the members named in
  ``reads``, each up to :data:`BULK_BYTES` (a bigger one as :class:`~llmgw.jsonbody.RawJSON`),
  every other member as one run of text (:data:`~llmgw.jsonbody.REST`), and the prompt text
  prefix routing hashes. Writing such a body out again (``jsonbody.dumps``) copies bytes and
  parses nothing: the router never holds the big body's millions of objects at all.

Both ways hold a body to ``jsonbody.MAX_DEPTH`` levels and check ``model`` and ``stream`` alike.
This module is what the worker process imports, so it imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from llmgw import jsonbody
from llmgw.jsonbody import REST, RawJSON
from llmgw.router.prefix import render_chat, render_prompt

SMALL_BYTES = 16 * 1024        # at most (n + 1) / 2 values in n bytes: always few enough to parse inline
INLINE_BYTES = 256 * 1024      # bigger bodies are never parsed inline
INLINE_VALUES = 8192           # ~0.5 ms of parsing at worst (many tiny arrays), as much again to check depth
BULK_BYTES = 16 * 1024         # a member the router reads, bigger than this, comes back as its text
WORKER_NICE = 10               # the worker's priority below the router's (Linux nice)


class BadBody(ValueError):
    """The request body cannot be routed; the message is the client's answer."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class ParserBusy(RuntimeError):
    """No worker took the body in time (or the worker died): a 503, worth retrying."""


@dataclass(frozen=True)
class Parsed:
    """A request body as the router uses it. ``body`` may hold :class:`RawJSON` values (a big body
    parsed in the worker); ``prompt`` is then its rendered prompt text (None: render from ``body``)."""

    body: dict[str, Any]
    model: str
    stream: bool
    prompt: str | None = None


def check_request(body: Any) -> tuple[str, bool]:
    """The body's ``model`` and whether it asks for a stream; :class:`BadBody` when it cannot be routed."""
    if type(body) is not dict:
        raise BadBody("The request body must be a JSON object.", "invalid_json")
    model = body.get("model")
    if type(model) is not str or not model:
        raise BadBody("The request body must name a `model` (a string).", "missing_model")
    stream = body.get("stream")
    # Strict: "stream": "no" is truthy, and guessing would answer SSE to a client expecting JSON.
    if stream is not None and type(stream) is not bool:
        raise BadBody("`stream` must be true or false.", "invalid_stream")
    return model, stream is True


def parse_body(raw: bytes) -> tuple[dict[str, Any], str, bool]:
    """The parsed body, its ``model``, and whether it asks for a stream; raises :class:`BadBody`."""
    try:
        body = jsonbody.loads(raw)
    except jsonbody.JSONBodyError as exc:
        raise BadBody(str(exc), "invalid_json") from None
    model, stream = check_request(body)
    return body, model, stream


def is_small(raw: bytes) -> bool:
    """Whether ``raw`` is cheap enough to parse on the event loop (see the module's docstring)."""
    if len(raw) <= SMALL_BYTES:
        return True
    if len(raw) > INLINE_BYTES:
        return False
    # Every JSON value is a container (counted by its opening bracket), the first in its
    # container, or after a comma: an upper bound on the values, at ~1 ns a byte.
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") <= INLINE_VALUES


# --- the worker's side ----------------------------------------------------------------------

@dataclass(frozen=True)
class Summary:
    """What the worker sends back: small however big the body was (but for the text in ``rest``
    and ``big``, which is copied, never parsed, by the router)."""

    model: str = ""
    stream: bool = False
    order: tuple[str, ...] = ()  # the members read, in the body's order
    read: dict[str, Any] = field(default_factory=dict)  # those up to BULK_BYTES, parsed
    big: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # the others: text, prompts in it
    rest: bytes = b""  # every member not read: `"name":value` pieces joined by commas
    prompt: str | None = None
    error: tuple[str, str] | None = None  # (message, code) of a body that cannot be routed

    def parsed(self) -> Parsed:
        body: dict[str, Any] = {}
        for name in self.order:
            if name in self.big:
                text, prompts = self.big[name]
                body[name] = RawJSON(text, prompts=prompts)
            else:
                body[name] = self.read[name]
        if self.rest:
            body[REST] = RawJSON(self.rest)
        return Parsed(body, self.model, self.stream, self.prompt)


def summarise(raw: bytes, kind: str | None, reads: frozenset[str], prompt_chars: int) -> Summary:
    """Parse ``raw`` (in the worker) into a :class:`Summary`. ``kind``: "chat", "prompt"
    (completions) or None, which prompt text to render, ``prompt_chars`` of it at most."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        members = _members(text)
    except (ValueError, RecursionError):
        # Not an object this walk reads: the whole-body parse gives the error every client gets.
        try:
            return _summary(_whole(raw), kind, reads, prompt_chars)
        except BadBody as exc:
            return Summary(error=(str(exc), exc.code))
    body = {name: value for name, _, _, _, value in members}  # json's own: first place, last value
    spans = {name: (start, colon, end) for name, start, colon, end, _ in members}
    try:
        if any(jsonbody.too_deep(v, jsonbody.MAX_DEPTH - 1) for v in body.values()):
            raise BadBody(jsonbody.too_deep_message(jsonbody.MAX_DEPTH), "invalid_json")
        return _summary(body, kind, reads, prompt_chars, text=text, spans=spans)
    except BadBody as exc:
        return Summary(error=(str(exc), exc.code))


def _whole(raw: bytes) -> dict[str, Any]:
    """``raw`` parsed as one (the way to the error message every client gets); :class:`BadBody`."""
    return parse_body(raw)[0]


def _summary(body: dict[str, Any], kind: str | None, reads: frozenset[str], prompt_chars: int, *,
             text: str = "", spans: dict[str, tuple[int, int, int]] | None = None) -> Summary:
    """The summary of ``body``, the text of each member taken from ``text`` at ``spans`` (name:
    where the member starts, where its value starts and ends), or written again without them."""
    model, stream = check_request(body)
    read: dict[str, Any] = {}
    big: dict[str, tuple[bytes, int]] = {}
    rest: list[str] = []
    for name, value in body.items():
        if spans is None:
            key = jsonbody.encode(name).decode("utf-8", "surrogatepass")
            member = key + ":" + jsonbody.encode(value).decode("utf-8", "surrogatepass")
            start, colon, end = 0, len(key) + 1, len(member)
        else:
            member = text
            start, colon, end = spans[name]
        if name not in reads:
            rest.append(member[start:end])
        elif end - colon <= BULK_BYTES or name == "model":
            read[name] = value
        else:
            big[name] = (member[colon:end].encode("utf-8", "surrogatepass"), _prompts(value))
    prompt = None
    if kind == "chat":
        prompt = render_chat(body, prompt_chars)[:prompt_chars]
    elif kind == "prompt":
        prompt = render_prompt(body)[:prompt_chars]
    return Summary(model, stream, tuple(n for n in body if n in reads), read, big,
                   ",".join(rest).encode("utf-8", "surrogatepass"), prompt)


def _prompts(value: Any) -> int:
    # The same rule as admission's (llmgw.router.limits): a list of strings or of token lists
    # is a batch, each prompt answered on its own.
    if type(value) is list and value and type(value[0]) in (str, list):
        return len(value)
    return 1


_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]  # the pattern always matches


def _members(text: str) -> list[tuple[str, int, int, int, Any]]:
    """The members of the JSON object ``text``: (name, key start, value start, value end, value),
    each value read by json's own parser; ValueError where ``text`` is not one object."""
    out: list[tuple[str, int, int, int, Any]] = []
    i = _ws(text, 0)
    if text[i:i + 1] != "{":
        raise ValueError("not an object")
    i = _ws(text, i + 1)
    if text[i:i + 1] == "}":
        i += 1
    else:
        while True:
            if text[i:i + 1] != '"':
                raise ValueError("expected a name")
            start = i
            name, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            i = _ws(text, i)
            if text[i:i + 1] != ":":
                raise ValueError("expected ':'")
            colon = _ws(text, i + 1)
            value, i = _DECODER.raw_decode(text, colon)
            out.append((name, start, colon, i, value))
            i = _ws(text, i)
            if text[i:i + 1] == ",":
                i = _ws(text, i + 1)
            elif text[i:i + 1] == "}":
                i += 1
                break
            else:
                raise ValueError("expected ',' or '}'")
    if _ws(text, i) != len(text):
        raise ValueError("extra data")
    return out


# --- the router's side ----------------------------------------------------------------------

def _worker_start() -> None:
    """In the worker: below the router's priority, and deaf to the terminal's ^C (the router
    stops it; a KeyboardInterrupt there would only break the pool mid-shutdown)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(WORKER_NICE)
    except OSError:
        pass  # not allowed here: the same priority is still off the event loop


class BodyParser:
    """Parses request bodies for one router: inline when small, else in a worker process.

    ``reads``: the top-level members the router reads (the worker sends only these back parsed).
    ``workers``: processes, and so big bodies parsed at once (0: every body inline, as before);
    started on the first big body, so a router that never sees one never starts one.
    ``wait``: seconds a big body may wait for a worker before it is answered 503.
    """

    def __init__(self, *, reads: frozenset[str], workers: int = 1, wait: float = 30.0,
                 prompt_chars: int = 64 * 512) -> None:
        self.reads = reads | {"model", "stream"}
        self.workers = workers
        self.wait = wait
        self.prompt_chars = prompt_chars
        self.offloaded = 0  # bodies handed to the worker since start
        self.parsing = 0  # bodies in the worker now
        self.waiting = 0  # bodies waiting for it
        self._pool: ProcessPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None

    async def parse(self, raw: bytes, kind: str | None) -> Parsed:
        """``raw`` parsed; :class:`BadBody` when it cannot be routed, :class:`ParserBusy` when no
        worker took it within ``wait`` seconds. ``kind`` as :func:`summarise`."""
        if self.workers <= 0 or is_small(raw):
            body, model, stream = parse_body(raw)
            return Parsed(body, model, stream)
        summary = await self._offload(raw, kind)
        if summary.error is not None:
            raise BadBody(*summary.error)
        return summary.parsed()

    async def _offload(self, raw: bytes, kind: str | None) -> Summary:
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        slots = self._slots
        self.waiting += 1
        try:
            async with asyncio.timeout(self.wait):
                await slots.acquire()
        except TimeoutError:
            raise ParserBusy(f"Every body parser has been busy for {self.wait:.0f} s with other large "
                             "request bodies; retry shortly.") from None
        finally:
            self.waiting -= 1
        pool = self._pool
        try:
            if pool is None:
                pool = self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                                        initializer=_worker_start)
            future = pool.submit(summarise, raw, kind, self.reads, self.prompt_chars)
        except BaseException:
            slots.release()
            raise
        # The slot is free when the worker is, not when the caller stops waiting: a client that
        # hangs up mid-parse must not let a second body in beside the one still being parsed.
        def done() -> None:
            self.parsing -= 1
            slots.release()

        def free(_future: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop already closed: nothing waits on the slot
                loop.call_soon_threadsafe(done)

        self.parsing += 1
        self.offloaded += 1
        future.add_done_callback(free)
        try:
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            if self._pool is pool:  # the worker died (killed, out of memory): a new one next time
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise ParserBusy("The request body parser stopped while reading this body; retry.") from None

    async def close(self) -> None:
        """Stop the worker (waiting for the body it is on, which is bounded by the body limit)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
