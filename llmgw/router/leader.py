"""Which controller a standalone router tries next, when several share one store (DESIGN §5).

One controller leads; the others stand by and answer the watch with 503 naming the leader
(:data:`llmgw.contract.STANDBY_TYPE`). The follower (:mod:`llmgw.router.follow`) tells
:class:`Leadership` how each attempt ended and is told whom to try next and how long to wait
first. Pure: no clock, no network; the randomness is injected.

How the next one is chosen, and why:

- A standby that names a leader the router was configured with is believed at once: the router
  goes there without waiting. A name outside the list is never contacted (the admin token would
  go to an address the operator did not give) and is handed back for the log.
- Otherwise the router tries the next controller in the list after a short jittered step, so a
  dead leader's routers reach a live controller well under a second later.
- A round is every configured controller tried once without a stream. Between rounds the router
  waits the capped, jittered, doubling backoff a router following one controller always had;
  but while some controller answers as a standby the wait is capped at
  :data:`STANDBY_ROUND_MAX`: a live standby means a handover is under way (a lease running out),
  and the new leader should be found seconds after it takes the lease, not ``backoff_max`` after.
- A hint to a controller already tried in this round is not followed again in it: a standby
  that still names the leader that just died (its lease has not run out yet) cannot keep the
  router going back and forth.
- A stream that was open and dropped starts a new round at the next controller: the one that
  dropped it may be dead, and if it is not, a standby's hint brings the router straight back.
"""

from __future__ import annotations

import enum
import random
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

FIRST_WAIT = 0.25  # after a dropped stream, and the first wait between rounds
STEP_WAIT = 0.1  # between controllers within a round
STANDBY_ROUND_MAX = 1.0  # the longest wait between rounds while a standby answers


class Outcome(enum.Enum):
    FOLLOWED = "followed"  # a stream was open; it ended
    STANDBY = "standby"  # the controller answered as a standby
    FAILED = "failed"  # unreachable, refused, or any other answer


@dataclass(frozen=True)
class Step:
    """What to do next: wait ``wait`` seconds, then try ``url``. ``ignored_hint`` is a leader a
    standby named that is not one of the configured controllers (not contacted; for the log)."""

    url: str
    wait: float
    ignored_hint: str | None = None


def same_controller(a: str, b: str) -> bool:
    """Whether two admin URLs name the same controller: scheme and host compared without case,
    a trailing slash ignored (the leader advertises its URL as its own config spells it)."""
    return _key(a) == _key(b)


def _key(url: str) -> tuple[str, str, str]:
    try:
        parts = urllib.parse.urlsplit(url.strip())
    except ValueError:
        return ("", url, "")
    return parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/")


class Leadership:
    """The controllers a router may follow and which of them it tries now (:attr:`url`).

    ``controllers`` keep their order (duplicates dropped); the first is tried first.
    :meth:`connected` marks the current one as followed; :meth:`after` records how an attempt
    ended and returns the next :class:`Step`. :attr:`switches` counts the times the router began
    following a controller other than the one it followed before (0 until the first change).
    """

    def __init__(self, controllers: Sequence[str], *, backoff_max: float = 10.0,
                 rng: random.Random | None = None) -> None:
        unique: list[str] = []
        for url in controllers:
            url = url.rstrip("/")
            if url and not any(same_controller(url, u) for u in unique):
                unique.append(url)
        if not unique:
            raise ValueError("no controller to follow")
        self.controllers: tuple[str, ...] = tuple(unique)
        self.backoff_max = max(backoff_max, FIRST_WAIT)
        self._rng = rng or random.Random()
        self.current = 0
        self.followed: int | None = None  # the controller whose stream is or was last open
        self.switches = 0
        self._delay = FIRST_WAIT
        self._tried: set[int] = set()
        self._standby_seen = False

    @property
    def url(self) -> str:
        """The controller to try now (while a stream is open: the one followed)."""
        return self.controllers[self.current]

    def index(self, url: str) -> int | None:
        """Where ``url`` is in the configured list, or None when it is not one of them."""
        return next((i for i, u in enumerate(self.controllers) if same_controller(u, url)), None)

    def connected(self) -> str | None:
        """The current controller's stream is open: it is followed now. Returns the controller
        followed before when this is a switch from it, else None."""
        before = self.followed
        self.followed = self.current
        self._delay = FIRST_WAIT
        self._tried.clear()
        self._standby_seen = False
        if before is not None and before != self.current:
            self.switches += 1
            return self.controllers[before]
        return None

    def after(self, outcome: Outcome, *, hint: str | None = None) -> Step:
        """How the attempt at :attr:`url` ended (``hint``: the leader a standby named); the next step."""
        n = len(self.controllers)
        if outcome is Outcome.FOLLOWED:
            self._tried.clear()
            self._standby_seen = False
            self._delay = FIRST_WAIT
            self.current = (self.current + 1) % n
            return Step(self.url, self._jitter(FIRST_WAIT))
        self._tried.add(self.current)
        ignored = None
        if outcome is Outcome.STANDBY:
            self._standby_seen = True
            if hint is not None:
                target = self.index(hint)
                if target is None:
                    ignored = hint
                elif target != self.current and target not in self._tried:
                    self.current = target
                    return Step(self.url, 0.0)
        if len(self._tried) >= n:  # a whole round without a stream
            wait = min(self._delay, STANDBY_ROUND_MAX) if self._standby_seen else self._delay
            self._delay = min(self._delay * 2, self.backoff_max)
            self._tried.clear()
            self._standby_seen = False
            self.current = (self.current + 1) % n
            return Step(self.url, self._jitter(wait), ignored)
        self.current = next(i % n for i in range(self.current + 1, self.current + n + 1) if i % n not in self._tried)
        return Step(self.url, self._jitter(STEP_WAIT), ignored)

    def _jitter(self, seconds: float) -> float:
        return seconds * (0.5 + self._rng.random())
