"""Credentials out of everything llmgw shows or stores: one function, used everywhere a URL (or a
text that may hold one, such as git's own error output) is shown, logged or stored.

An operator may follow ``https://user:TOKEN@host/catalog.git``: the controller fetches and pushes
with it, but the token had reached /api/v1/sync, the events (stored), the start-up banner, the
logs and the dashboard. git itself drops a URL's user and password from its messages but echoes a
query string (``?private_token=...``) whole, so its stderr goes through here too.

What is hidden, in every ``scheme://`` URL found in the text:
- over HTTP(S) the whole user part, which is how tokens are passed (``https://TOKEN@host``,
  ``https://TOKEN:x-oauth-basic@github.com``): ``https://***@host``; it runs to the last "@"
  before a space, so a password holding a quote, "/" or "<" is hidden whole;
- over other schemes the password of ``user:password@`` (``ssh://git:***@host``); there a lone
  user is a login name (``ssh://git@host``) and stays;
- every query value: ``?private_token=***`` (a URL's query names no secret that deserves showing,
  and a list of secret-looking names would be a deny-list).
Pure, no I/O: the catalog, the router and the admin API may all use it.
"""

from __future__ import annotations

import logging
import re

MASK = "***"
# A URL in free text: it ends where the text puts a space or a quote around it (git writes
# 'https://host/x.git/'), and its authority ends at the first "/", "?" or "#".
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#\s'\"<>`]*)(?P<rest>[^\s'\"<>`]*)"
                  r"(?P<after>\S*)")
_TOKEN_SCHEMES = frozenset({"http", "https", "ftp", "ftps"})
_STOPS = "'\"<>`"


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***`` (see the module)."""
    if "://" not in text:
        return text
    return _URL.sub(_redact_match, text)


def _redact_match(match: re.Match[str]) -> str:
    scheme, authority, rest = match.group("scheme"), match.group("authority"), match.group("rest")
    after = match.group("after")  # the rest of the word, past a quote that ended the URL
    stopped_at_quote = not rest and after[:1] in tuple(_STOPS)
    word = authority + rest + after
    if "@" not in authority and "@" in rest + after and (":" in authority or stopped_at_quote):
        # "user:pa/ss@host", "user:pa'ss@host": a password holding "/", "?", "#" or a quote
        # unencoded ends the authority early; up to the last "@" before a space is taken as the
        # user part (hiding too much, never too little).
        userinfo, _, tail = word.rpartition("@")
        end = next((i for i, ch in enumerate(tail) if ch in "/?#" + _STOPS), len(tail))
        authority, rest = f"{userinfo}@{tail[:end]}", ""
        tail = tail[end:]
        stop = next((i for i, ch in enumerate(tail) if ch in _STOPS), len(tail))
        rest, after = tail[:stop], tail[stop:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        if scheme.lower().rsplit("+", 1)[-1] in _TOKEN_SCHEMES:  # git+https:// too
            # Over HTTP the user part is as often the token as the password is
            # (https://TOKEN:x-oauth-basic@github.com): all of it is hidden.
            userinfo = MASK
        elif ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":" + MASK
        authority = f"{userinfo}@{host}"
    path, mark, query = rest.partition("?")
    if mark:
        query, hash_, fragment = query.partition("#")
        query = "&".join(_redact_param(p) for p in query.split("&")) + hash_ + fragment
    # What follows the URL in the same word may hold another one ('a','https://u:p@h').
    return f"{scheme}://{authority}{path}{mark}{query}{redact(after) if after else ''}"


def _redact_param(param: str) -> str:
    if not param:
        return param
    name, eq, _value = param.partition("=")
    return f"{name}={MASK}" if eq else MASK


class RedactingFormatter(logging.Formatter):
    """Formats as the formatter it wraps, then redacts: messages, their arguments and tracebacks
    alike (an exception from git or an HTTP client can carry a URL); and shows every control
    character but the line breaks of a traceback as an escape (a commit subject or an engine's
    error quoted in a log line must not drive the terminal reading the log)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self._inner = inner

    def format(self, record: logging.LogRecord) -> str:
        from llmgw.safetext import visible

        return "\n".join(visible(line) for line in redact(self._inner.format(record)).split("\n"))


def redact_logs(logger: logging.Logger | None = None) -> None:
    """Make every handler of ``logger`` (the root one by default) redact what it writes; call it
    once logging is configured."""
    for handler in (logger or logging.getLogger()).handlers:
        if not isinstance(handler.formatter, RedactingFormatter):
            handler.setFormatter(RedactingFormatter(handler.formatter or logging.Formatter()))
