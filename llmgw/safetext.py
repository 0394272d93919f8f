"""Catalog text made safe to show: one function per output format, used for every string that a
catalog, a snapshot or a node supplies (standard library only: the CLI imports it at start-up).

A catalog is written by whoever opens a pull request. `llmgw diff` puts its text in a PR comment
and on a reviewer's terminal, so that text must be shown, never obeyed: an ``args`` string with
an ESC sequence would otherwise clear the reviewer's screen or plant an OSC 8 link, and one with
a blank line, ``**…**``, a link and a closing fence would end the comment's table and write its
own "safe to merge" verdict under the bot's name.
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, the line/paragraph separators and the bidirectional overrides (text
# that reads differently from the bytes it is, "Trojan Source").
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# Everything markdown (GitHub's flavour) or the HTML around it could act on: emphasis, code, links
# (no "[", so "(" is plain), headings, tables, strikethrough, tags and entities, and the ":" of
# autolinked URLs and :emoji:. Quotes are plain: the text never lands in an attribute.
_MARKDOWN = {ch: f"&#{ord(ch)};" for ch in "&<>`*_[]#|\\~:@"}
_WORD_JOINER = "\u2060"  # after @: GitHub links a mention on the decoded text, entity or not


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(match.group()) or (
        f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def visible(text: object) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``, ``\\n``, ``\\u202e``):
    for a terminal and plain text. Nothing else changes (rich markup is the printer's business:
    print the result as plain text, never as markup)."""
    return _CONTROL.sub(_escape, str(text))


def markdown(text: object) -> str:
    """``text`` as literal characters anywhere in a GitHub comment: a table cell, a ``<code>``,
    a ``<summary>`` (so no backtick code spans around it: a backtick in the text would end one).

    Control characters as in :func:`visible` (a newline shows as ``\\n``: it cannot end the cell
    or the block), then every character markdown or HTML gives a meaning as a numeric entity, which
    both render as the character itself; a mention is broken with an invisible word joiner.
    """
    out = "".join(_MARKDOWN.get(ch, ch) for ch in visible(text))
    return out.replace("&#64;", "&#64;" + _WORD_JOINER)
