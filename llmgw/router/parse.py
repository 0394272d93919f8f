"""Reading a request body without stalling the router for every other client (issue 24).

A body is parsed on the one event loop every request shares: a 30 MB body of small messages
held it for 0.4–1.8 s, and two senders of such bodies cut another tenant's completed requests
from 1,282 to 28 in 10 s. A thread does not help: json's C parser holds the GIL for the whole
parse (measured: the loop's longest pause equals the parse time, threaded or not). So:

- **Small bodies are parsed inline**: up to :data:`SMALL_BYTES`, or up to :data:`INLINE_BYTES`
  with at most :data:`INLINE_VALUES` JSON values (counted from the separators, an upper bound).
  That is at most ~1 ms of the loop, less than handing the body to another process costs,
  and it is nearly every request (a long chat is a few hundred values).
- **Bigger ones go to a worker process** (``python -m llmgw.router.parse``, on pipes), at most
  ``workers`` at a time (waiting is bounded), run at a lower priority so the router and the
  engines come first on a busy machine. The body goes down the pipe a megabyte at a time. What
  comes back is only what the router reads (:class:`Summary`): the members named in ``reads``,
  each up to :data:`BULK_BYTES` (a bigger one as :class:`~llmgw.jsonbody.RawJSON`), where every
  other member is in the body's bytes (:data:`~llmgw.jsonbody.REST`), and the prompt text prefix
  routing hashes. The router keeps those parts as views of the bytes it has; writing the body
  out again (``jsonbody.dumps``) copies them once and parses nothing. It never holds the big
  body's millions of objects at all, nor copies the body whole on the event loop.

Both ways hold a body to ``jsonbody.MAX_DEPTH`` levels and check ``model`` and ``stream`` alike.
This module is what the worker process imports, so it imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import pickle
import re
import signal
import struct
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmgw import jsonbody
from llmgw.jsonbody import REST, RawJSON
from llmgw.router.prefix import render_chat, render_prompt

log = logging.getLogger(__name__)

SMALL_BYTES = 8 * 1024         # at most (n + 1) / 2 values in n bytes: never more than INLINE_VALUES
INLINE_BYTES = 256 * 1024      # bigger bodies are never parsed inline
INLINE_VALUES = 4096           # ~0.6 ms to parse and check at worst (tiny objects); a long chat is a few hundred
BULK_BYTES = 4 * 1024          # a member the router reads, bigger than this, comes back as its text
MAX_MODEL_CHARS = 256          # catalog names and aliases have at most 128
MAX_PIECES = 64                # runs of members not read sent back as spans; more: as one text
WORKER_NICE = 10               # the worker's priority below the router's (Linux nice)
# Parse cost bounds, checked in the worker before parsing: 32 MB of `"":0` members (6.4 million)
# held the one worker for 17 s and 1.3 GB, while other tenants' big bodies waited; refused here in
# ~1.5 s. A real request has tens of top-level members; 2 million values is ~650,000 chat messages
# (each message is 3: its object, role and content), far more than any context holds.
MAX_VALUES = 2_000_000
MAX_MEMBERS = 10_000
PER_SENDER = 2                 # big bodies one sender may have waiting for or in the parser
_CHUNK = 1024 * 1024           # a big body is read, and sent to the worker, this much at a time


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


class BodyTooLarge(ValueError):
    """The body is longer than the limit (a 413)."""


class BuffersFull(RuntimeError):
    """Holding more of a body would pass the router's total or one sender's share (a 503/429)."""

    def __init__(self, message: str, *, share: bool) -> None:
        super().__init__(message)
        self.share = share  # the sender's own share (a 429: theirs to slow down), not the total


class TooManyBodies(RuntimeError):
    """One sender has as many big bodies waiting for or in the parser as it may (a 429)."""


class Buffers:
    """Bytes of request bodies the router holds: in all, and per sender (API key name, or client
    address on an open router). Counted as they are read, not once a body is whole: counted only
    then, any number of concurrent uploads each passed the check and were all held (12 × 30 MB
    against a 64 MiB limit). The share per sender keeps one key from filling the total, which would
    make every other tenant's smallest request a 503."""

    def __init__(self, *, limit: int, share: int) -> None:
        self.limit = limit
        self.share = share
        self.total = 0
        self.held: dict[str, int] = {}

    def take(self, who: str, size: int) -> None:
        """Hold ``size`` more bytes for ``who``, else :class:`BuffersFull` (nothing taken)."""
        mine = self.held.get(who, 0)
        if mine + size > self.share:
            raise BuffersFull(f"This client holds {mine} bytes of request bodies in flight; one client may hold "
                              f"{self.share} (a share of the router's {self.limit}); retry when some have "
                              "finished.", share=True)
        if self.total + size > self.limit:
            raise BuffersFull(f"The router holds {self.total} bytes of request bodies in flight, its limit "
                              f"({self.limit}); retry shortly.", share=False)
        self.total += size
        self.held[who] = mine + size

    def give(self, who: str, size: int) -> None:
        self.total -= size
        left = self.held.get(who, 0) - size
        if left > 0:
            self.held[who] = left
        else:
            self.held.pop(who, None)


@dataclass
class Hold:
    """What one request holds in :class:`Buffers`; :meth:`release` gives it all back."""

    buffers: Buffers
    who: str
    size: int = 0

    def cover(self, size: int) -> None:
        """Hold at least ``size`` bytes (a body read so far, or its Content-Length up front)."""
        if size > self.size:
            self.buffers.take(self.who, size - self.size)
            self.size = size

    def release(self) -> None:
        self.buffers.give(self.who, self.size)
        self.size = 0


class _Chunks(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


async def read_body(content: _Chunks, limit: int, hold: Hold | None = None) -> bytes:
    """A request's whole body (aiohttp's ``request.content``), at most ``limit`` bytes, else
    :class:`BodyTooLarge`; each piece counted in ``hold`` as it arrives (:class:`BuffersFull`).

    aiohttp's own ``request.read()`` goes through whatever has arrived in one step and grows one
    buffer as it goes: 16-25 ms of the event loop for a 30 MB body. Here the loop is let go
    every megabyte, and the pieces are joined once at the end (~3 ms for 30 MB)."""
    pieces: list[bytes] = []
    size = since = 0
    async for piece in content.iter_any():
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            raise BodyTooLarge(f"more than {limit} bytes")
        if hold is not None:
            hold.cover(size)
        since += len(piece)
        if since >= _CHUNK:
            since = 0
            await asyncio.sleep(0)
    return b"".join(pieces)


def check_request(body: Any) -> tuple[str, bool]:
    """The body's ``model`` and whether it asks for a stream; :class:`BadBody` when it cannot be routed."""
    if type(body) is not dict:
        raise BadBody("The request body must be a JSON object.", "invalid_json")
    model = body.get("model")
    if type(model) is not str or not model:
        raise BadBody("The request body must name a `model` (a string).", "missing_model")
    if len(model) > MAX_MODEL_CHARS:  # no name is that long; and the 404 would echo it all back
        raise BadBody(f"`model` is {len(model)} characters long: no model or alias has a name longer than "
                      f"{MAX_MODEL_CHARS}.", "model_not_found")
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

Piece = tuple[int, int] | bytes  # where in the body's bytes (start, end), or the text itself


@dataclass(frozen=True)
class Summary:
    """What the worker sends back: small however big the body was. The big parts are named by
    where they are in the body's bytes, which the router holds already (only a body in another
    encoding than UTF-8 has its parts sent back as UTF-8 text)."""

    model: str = ""
    stream: bool = False
    order: tuple[str, ...] = ()  # the members read, in the body's order
    read: dict[str, Any] = field(default_factory=dict)  # those up to BULK_BYTES, parsed
    big: dict[str, tuple[Piece, int]] = field(default_factory=dict)  # the others: value, prompts in it
    rest: tuple[Piece, ...] = ()  # every member not read, each `"name":value`
    prompt: str | None = None
    error: tuple[str, str] | None = None  # (message, code) of a body that cannot be routed

    def parsed(self, raw: bytes) -> Parsed:
        """The body for the router, its big parts read from ``raw`` (views, not copies)."""
        view = memoryview(raw)

        def text(piece: Piece) -> jsonbody.Text:
            return piece if isinstance(piece, bytes) else view[piece[0]:piece[1]]

        body: dict[str, Any] = {}
        for name in self.order:
            if name in self.big:
                piece, prompts = self.big[name]
                body[name] = RawJSON(text(piece), prompts=prompts)
            else:
                body[name] = self.read[name]
        if self.rest:
            body[REST] = RawJSON(*(text(p) for p in self.rest))
        return Parsed(body, self.model, self.stream, self.prompt)


def summarise(raw: bytes, kind: str | None, reads: frozenset[str], prompt_chars: int) -> Summary:
    """Parse ``raw`` (in the worker) into a :class:`Summary`. ``kind``: "chat", "prompt"
    (completions) or None, which prompt text to render, ``prompt_chars`` of it at most."""
    try:
        encoding = json.detect_encoding(raw)
        text = raw.decode(encoding, "surrogatepass")
        _check_values(text)
        members = _members(text)
    except BadBody as exc:
        return Summary(error=(str(exc), exc.code))
    except (ValueError, RecursionError):
        # Not an object this walk reads: the whole-body parse gives the error every client gets.
        try:
            return _rewritten(parse_body(raw)[0], kind, reads, prompt_chars)
        except BadBody as exc:
            return Summary(error=(str(exc), exc.code))
    body = {name: value for name, _, _, _, value in members}  # json's own: first place, last value
    try:
        if any(jsonbody.too_deep(v, jsonbody.MAX_DEPTH - 1) for v in body.values()):
            raise BadBody(jsonbody.too_deep_message(jsonbody.MAX_DEPTH), "invalid_json")
        model, stream = check_request(body)
    except BadBody as exc:
        return Summary(error=(str(exc), exc.code))
    where = _Offsets(text, raw, encoding) if encoding.startswith("utf-8") else _Encoded(text)
    last = {name: start for name, start, _, _, _ in members}
    read: dict[str, Any] = {}
    big: dict[str, tuple[Piece, int]] = {}
    runs: list[Piece] = []
    run: list[int] = []  # [start, end] of the members not read since the last one read
    # One pass in the body's order (character offsets become byte offsets counting forward). A
    # run of members not read is one piece, however many members it holds; a member read ends a
    # run, and only its last occurrence counts (an earlier one left in the text would be what an
    # engine reading the last occurrence saw: `"max_tokens": 50000, ..., "max_tokens": 1`).
    for name, start, colon, end, value in members:
        if name not in reads:
            run = [run[0] if run else start, end]
            continue
        if run:
            runs.append(where(*run))
            run = []
        if last[name] != start:
            continue
        if end - colon <= BULK_BYTES or name == "model":
            read[name] = value
        else:
            big[name] = (where(colon, end), _prompts(value))
    if run:
        runs.append(where(*run))
    if len(runs) > MAX_PIECES:  # members read repeated to cut the rest into a million runs
        runs = [b",".join(p if isinstance(p, bytes) else raw[p[0]:p[1]] for p in runs)]
    return Summary(model, stream, tuple(n for n in body if n in reads), read, big, tuple(runs),
                   _prompt_text(body, kind, prompt_chars))


def _rewritten(body: dict[str, Any], kind: str | None, reads: frozenset[str], prompt_chars: int) -> Summary:
    """The summary of a body parsed whole, its parts written again (a body the member walk did
    not read but json did; none is known)."""
    model, stream = check_request(body)
    read: dict[str, Any] = {}
    big: dict[str, tuple[Piece, int]] = {}
    rest: list[bytes] = []
    for name, value in body.items():
        text = jsonbody.encode(value)
        if name not in reads:
            rest.append(jsonbody.encode(name) + b":" + text)
        elif len(text) <= BULK_BYTES or name == "model":
            read[name] = value
        else:
            big[name] = (text, _prompts(value))
    return Summary(model, stream, tuple(n for n in body if n in reads), read, big,
                   (b",".join(rest),) if rest else (), _prompt_text(body, kind, prompt_chars))


def _prompt_text(body: dict[str, Any], kind: str | None, prompt_chars: int) -> str | None:
    if kind == "chat":
        return render_chat(body, prompt_chars)[:prompt_chars]
    if kind == "prompt":
        return render_prompt(body)[:prompt_chars]
    return None


class _Offsets:
    """Pieces of a UTF-8 body as byte spans: character offsets in ``text`` turned into byte
    offsets in ``raw``, counting the bytes in between once, in order."""

    def __init__(self, text: str, raw: bytes, encoding: str) -> None:
        self.text = text
        self.base = 3 if encoding == "utf-8-sig" else 0  # the byte order mark, not in ``text``
        self.ascii = raw.isascii()
        self.char, self.byte = 0, self.base

    def __call__(self, start: int, end: int) -> Piece:
        return self.at(start), self.at(end)

    def at(self, char: int) -> int:
        if self.ascii:
            return self.base + char
        if char < self.char:  # asked out of order: counted from the start again
            self.char, self.byte = 0, self.base
        self.byte += len(self.text[self.char:char].encode("utf-8", "surrogatepass"))
        self.char = char
        return self.byte


class _Encoded:
    """Pieces of a body in UTF-16 or UTF-32 as UTF-8 text (its bytes cannot be forwarded in parts)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __call__(self, start: int, end: int) -> Piece:
        return self.text[start:end].encode("utf-8", "surrogatepass")


def _prompts(value: Any) -> int:
    # The same rule as admission's (llmgw.tenancy.asked): a list of strings or of token lists
    # is a batch, each prompt answered on its own.
    if type(value) is list and value and type(value[0]) in (str, list):
        return len(value)
    return 1


_WS = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def _values(text: str) -> int:
    """An upper bound on the JSON values in ``text``: its commas and opening brackets."""
    return text.count(",") + text.count("[") + text.count("{") + 1


def _check_values(text: str) -> None:
    """:class:`BadBody` when ``text`` holds more than :data:`MAX_VALUES` values. Counted outside
    strings only when the quick count is over (a long document full of commas is fine)."""
    if _values(text) > MAX_VALUES and _values(_STRING.sub('""', text)) > MAX_VALUES:
        raise BadBody(f"The request body holds more than {MAX_VALUES:,} JSON values (the router's limit).",
                      "too_many_values")
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
            if len(out) > MAX_MEMBERS:
                raise BadBody(f"The request body has more than {MAX_MEMBERS:,} top-level members (the router's "
                              "limit).", "too_many_members")
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


# The worker's end of the pipe: a request is a 4-byte header length, an 8-byte body length, the
# header (JSON: kind, reads, prompt_chars) and the body; an answer is an 8-byte length and the
# pickled Summary (the router reads pickles from its own child only).
_REQUEST = struct.Struct(">IQ")
_ANSWER = struct.Struct(">Q")


def worker_main() -> None:
    """``python -m llmgw.router.parse``: answer requests on stdin until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is the router's to act on
    with contextlib.suppress(OSError):  # not allowed here: the same priority, still off the event loop
        os.nice(WORKER_NICE)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while len(head := inp.read(_REQUEST.size)) == _REQUEST.size:
        header_size, size = _REQUEST.unpack(head)
        header = json.loads(inp.read(header_size))
        raw = inp.read(size)
        if len(raw) != size:
            return
        summary = summarise(raw, header["kind"], frozenset(header["reads"]), header["prompt_chars"])
        data = pickle.dumps(summary, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(_ANSWER.pack(len(data)) + data)
        out.flush()


# --- the router's side ----------------------------------------------------------------------

class _Worker:
    """One worker process and its pipes; one body at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls) -> _Worker:
        # A process of its own (not multiprocessing's spawn, which imports the parent's __main__
        # again and pickles the whole body in one go under the GIL: 43 ms for 30 MB).
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "llmgw.router.parse",
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        pipe = proc.stdin.get_extra_info("pipe") if proc.stdin is not None else None
        if pipe is not None and hasattr(fcntl, "F_SETPIPE_SZ"):
            # A megabyte a write rather than 64 KiB (Linux): fewer turns of the loop per body.
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, _CHUNK)
        return cls(proc)

    async def summarise(self, raw: bytes, header: bytes) -> Summary:
        """The worker's summary of ``raw``; ``ConnectionError`` when the worker is gone."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(_REQUEST.pack(len(header), len(raw)) + header)
            view = memoryview(raw)
            for i in range(0, len(raw), _CHUNK):
                stdin.write(view[i:i + _CHUNK])
                await stdin.drain()
            size, = _ANSWER.unpack(await stdout.readexactly(_ANSWER.size))
            summary: Summary = pickle.loads(await stdout.readexactly(size))
        except asyncio.IncompleteReadError as exc:
            raise ConnectionResetError("the parse worker exited") from exc
        return summary

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


class BodyParser:
    """Parses request bodies for one router: inline when small, else in a worker process.

    ``reads``: the top-level members the router reads (the worker sends only these back parsed).
    ``workers``: processes, and so big bodies parsed at once (0: every body inline, as before);
    started on the first big body, so a router that never sees one never starts one.
    ``wait``: seconds a big body may wait for a worker before it is answered 503.
    ``per_sender``: big bodies one sender (``who``) may have waiting or parsing at once; more is
    :class:`TooManyBodies`, so one key's bodies cannot keep every other tenant's waiting.
    """

    def __init__(self, *, reads: frozenset[str], workers: int = 1, wait: float = 30.0,
                 prompt_chars: int = 64 * 512, per_sender: int = PER_SENDER) -> None:
        self.reads = reads | {"model", "stream"}
        self.workers = workers
        self.wait = wait
        self.prompt_chars = prompt_chars
        self.offloaded = 0  # bodies handed to a worker since start
        self.parsing = 0  # bodies in a worker now
        self.waiting = 0  # bodies waiting for one
        self.per_sender = per_sender
        self._queued: dict[str, int] = {}  # sender -> its bodies waiting for or in a worker
        self._idle: list[_Worker] = []
        self._busy: set[asyncio.Task[Summary]] = set()
        self._slots: asyncio.Semaphore | None = None
        self._closed = False

    async def parse(self, raw: bytes, kind: str | None, who: str = "") -> Parsed:
        """``raw`` parsed; :class:`BadBody` when it cannot be routed, :class:`ParserBusy` when no
        worker took it within ``wait`` seconds (or it died on it). ``kind`` as :func:`summarise`."""
        if self.workers <= 0 or is_small(raw):
            body, model, stream = parse_body(raw)
            return Parsed(body, model, stream)
        queued = self._queued.get(who, 0)
        if queued >= self.per_sender:
            raise TooManyBodies(f"This client has {queued} large request bodies waiting for or being parsed, "
                                f"the most one client may ({self.per_sender}); retry when one is answered.")
        self._queued[who] = queued + 1
        try:
            summary = await self._offload(raw, kind)
        finally:
            if (left := self._queued[who] - 1) > 0:
                self._queued[who] = left
            else:
                del self._queued[who]
        if summary.error is not None:
            raise BadBody(*summary.error)
        return summary.parsed(raw)

    async def _offload(self, raw: bytes, kind: str | None) -> Summary:
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
        self.parsing += 1
        self.offloaded += 1
        header = json.dumps({"kind": kind, "reads": sorted(self.reads), "prompt_chars": self.prompt_chars}).encode()
        # The exchange runs to its end even when the client hangs up (the caller is cancelled): the
        # worker is busy with the body either way, and its pipe must not be left mid-message.
        task = asyncio.create_task(self._exchange(raw, header))
        self._busy.add(task)

        def done(t: asyncio.Task[Summary]) -> None:
            self._busy.discard(t)
            self.parsing -= 1
            slots.release()

        task.add_done_callback(done)
        try:
            return await asyncio.shield(task)
        except OSError:  # the worker died with it, or none could be started
            raise ParserBusy("The request body parser stopped while reading this body; retry.") from None

    async def _exchange(self, raw: bytes, header: bytes) -> Summary:
        try:
            worker = self._idle.pop() if self._idle else await _Worker.start()
        except OSError as exc:
            log.error("cannot start a request body parser: %s", exc)
            raise
        try:
            summary = await worker.summarise(raw, header)
        except BaseException as exc:
            await worker.stop()
            if isinstance(exc, ConnectionError):
                log.error("the request body parser (pid %d) exited with %s; a new one takes the next body",
                          worker.proc.pid, worker.proc.returncode)
            raise
        if self._closed:
            await worker.stop()
        else:
            self._idle.append(worker)
        return summary

    async def close(self) -> None:
        """Stop the workers, after the bodies they are on (bounded by the body limit)."""
        self._closed = True
        if self._busy:
            await asyncio.wait(set(self._busy))
        idle, self._idle = self._idle, []
        for worker in idle:
            await worker.stop()


if __name__ == "__main__":
    # Through the module's own name: what the worker pickles must name llmgw.router.parse.Summary,
    # the class the router unpickles, not __main__'s copy of it.
    import llmgw.router.parse

    llmgw.router.parse.worker_main()
