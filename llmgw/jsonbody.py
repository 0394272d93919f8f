"""JSON from outside, read with bounded nesting: one parse for every listener that takes a body.

Python's parser stops at about 1,000 levels (``RecursionError``), but what is read is later
written again (a field set before forwarding, a prompt rendered), handed to engines, and logged,
each with less stack left: a 976-deep body passed the router's parse and was a 500 with a
traceback further on. So every body is held to :data:`MAX_DEPTH` levels, far above any real
request (an OpenAI chat body with images and a tool schema is about 10 deep), and one deeper is
refused with an error that names the limit. Used by the router, the admin API and the
controller's report endpoint alike.

:class:`RawJSON` and :func:`dumps` serve the router's big bodies (``llmgw.router.parse``): parts
of a body it never reads stay as their text, and are written out again byte for byte.

Pure, standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

MAX_DEPTH = 64  # levels of arrays and objects, the outermost one included


class JSONBodyError(ValueError):
    """A body that is not the JSON asked for; the message says what is wrong, for the client."""


def loads(raw: bytes | str, *, max_depth: int = MAX_DEPTH, what: str = "The request body") -> Any:
    """``raw`` parsed, at most ``max_depth`` levels deep; :class:`JSONBodyError` otherwise.

    ``what`` names the body in the messages ("The request body is not valid JSON: ...")."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JSONBodyError(too_deep_message(max_depth, what)) from None
    except ValueError as exc:  # includes UnicodeDecodeError
        raise JSONBodyError(f"{what} is not valid JSON: {exc}") from None
    if too_deep(value, max_depth):
        raise JSONBodyError(too_deep_message(max_depth, what))
    return value


def too_deep_message(max_depth: int, what: str = "The request body") -> str:
    return f"{what} nests arrays and objects more than {max_depth} levels deep (the limit)."


def too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` levels (``value`` itself is one).

    Level by level, not recursively: the walk itself must not run out of stack."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for v in level:
            children = v.values() if type(v) is dict else v
            below += [c for c in children if type(c) is dict or type(c) is list]
        level = below
    return False


Text = bytes | memoryview  # a memoryview: a part of the body as it came, not copied


class RawJSON:
    """A JSON value kept as its UTF-8 text; under :data:`REST`, object members (``"name":value``),
    one piece each.

    ``prompts``: for a completions ``prompt``, how many prompts it holds (a batch is a list of
    strings or of token lists), which admission multiplies by and cannot read from text.
    Anything that reads a body the router parsed in its worker finds these in place of the
    big values; :func:`dumps` writes them out unchanged.
    """

    __slots__ = ("pieces", "prompts")

    def __init__(self, *pieces: Text, prompts: int = 1) -> None:
        self.pieces = pieces
        self.prompts = prompts

    def __len__(self) -> int:
        return sum(len(p) for p in self.pieces)

    def __repr__(self) -> str:
        return f"<{len(self):,} bytes of JSON>"


# The key under which the members nobody reads are kept: a body of a million small members must
# not become a million objects. A client cannot send it: a key from JSON text is a str value,
# never a RawJSON.
REST = "\x00llmgw.rest"


def dumps(body: Mapping[str, Any]) -> bytes:
    """A JSON object as compact UTF-8 text, :class:`RawJSON` values written as they are.

    A lone surrogate (half an emoji cut by a client, ``"\\ud83d"``) cannot be encoded as UTF-8:
    such a value is written with its escapes kept."""
    if not any(type(v) is RawJSON for v in body.values()):
        return encode(body)
    out: list[Text] = []
    for key, value in body.items():
        if type(value) is not RawJSON:
            out += (b",", encode(key), b":", encode(value))
        elif key == REST:
            for piece in value.pieces:
                out += (b",", piece)
        else:
            out += (b",", encode(key), b":", *value.pieces)
    if not out:
        return b"{}"
    out[0] = b"{"  # in place of the first member's comma
    out.append(b"}")
    return b"".join(out)  # the one copy of the big parts


def encode(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON (a lone surrogate kept as its escape)."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()
