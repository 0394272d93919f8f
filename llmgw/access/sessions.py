"""Dashboard sessions of people signed in at the provider, and sign-ins under way. In memory:
a restarted controller asks people to sign in again, and no session outlives the token it
was opened with."""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.access.roles import Principal

LIFETIME = 8 * 3600.0  # at most, whatever the provider's token allows
SIGN_IN_WINDOW = 600.0  # from the redirect to the provider until its answer comes back
MAX_SESSIONS = 10_000
MAX_PENDING = 1_000  # sign-ins started and not finished: the oldest are dropped first


@dataclass(frozen=True)
class Session:
    principal: Principal
    expires: float
    csrf: str  # sent back with every POST a page makes (header X-CSRF-Token or a form's csrf field)


@dataclass(frozen=True)
class Pending:
    verifier: str  # PKCE: the code is worth nothing without it (it never leaves this controller)
    nonce: str  # the ID token must carry it: a token minted for another sign-in is refused
    redirect_uri: str
    started: float


class Sessions:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._open: OrderedDict[str, Session] = OrderedDict()
        self._pending: OrderedDict[str, Pending] = OrderedDict()

    def begin(self, redirect_uri: str) -> tuple[str, Pending]:
        """A sign-in's state (the key its answer comes back with) and what finishing it needs."""
        state = secrets.token_urlsafe(24)
        self._pending[state] = Pending(secrets.token_urlsafe(48), secrets.token_urlsafe(24), redirect_uri,
                                       self._clock())
        now = self._clock()
        for old in [k for k, v in self._pending.items() if now - v.started > SIGN_IN_WINDOW]:
            del self._pending[old]  # the expired first; only then, past the cap, the oldest
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        return state, self._pending[state]

    def finish(self, state: str) -> Pending | None:
        """The sign-in ``state`` names, once (a replayed answer finds nothing), if not too old."""
        pending = self._pending.pop(state, None)
        if pending is None or self._clock() - pending.started > SIGN_IN_WINDOW:
            return None
        return pending

    def open(self, principal: Principal, until: float) -> tuple[str, Session]:
        sid = secrets.token_urlsafe(32)
        self._open[sid] = Session(principal, min(until, self._clock() + LIFETIME), secrets.token_urlsafe(24))
        while len(self._open) > MAX_SESSIONS:
            self._open.popitem(last=False)
        return sid, self._open[sid]

    def get(self, sid: str) -> Session | None:
        session = self._open.get(sid)
        if session is not None and session.expires <= self._clock():
            del self._open[sid]
            return None
        return session

    def close(self, sid: str) -> None:
        self._open.pop(sid, None)


def csrf_ok(session: Session, given: str) -> bool:
    return bool(given) and hmac.compare_digest(session.csrf.encode(), given.encode("utf-8", "surrogateescape"))
