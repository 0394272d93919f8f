"""How the controller's background loops are faring: the one record every loop keeps.

A loop that catches everything so that it outlives a bug used to look healthy while every turn
failed (a reconcile tick raising each second, a git sync that could not run): logged, nothing
more. Each loop now says each turn's outcome here, and the controller's status, admin API,
dashboard and ``/metrics`` read it, so "every tick fails" is visible where an operator looks.

Pure: no I/O, no clock of its own (callers pass ``now``), safe to read from any thread (a record
is replaced whole, never mutated in place).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace

from llmgw.redact import redact

# Consecutive failures after which a loop is unhealthy rather than merely degraded: one failure
# can be a moment's trouble (a node that hung up mid-call); three in a row is a loop that is not
# doing its job.
UNHEALTHY_AFTER = 3
ERROR_CHARS = 800  # a traceback's message can be long; status and metrics carry its head


@dataclass(frozen=True)
class LoopHealth:
    name: str
    # Whether the controller is unfit when this loop keeps failing (a reconcile tick, leadership),
    # as against a loop that waits on something outside it (git fetching from a remote that is
    # down): the controller still serves its last good state then, and a restart would not help.
    critical: bool = True
    last_ok: float | None = None
    last_failure: float | None = None
    consecutive_failures: int = 0
    failures: int = 0  # since start
    last_error: str | None = None

    @property
    def state(self) -> str:
        """"ok", "degraded" (failing, not for long) or "unhealthy" (failed UNHEALTHY_AFTER times in a row)."""
        if self.consecutive_failures >= UNHEALTHY_AFTER:
            return "unhealthy"
        return "degraded" if self.consecutive_failures else "ok"

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name, "state": self.state, "critical": self.critical, "last_ok": self.last_ok,
            "last_failure": self.last_failure, "consecutive_failures": self.consecutive_failures,
            "failures": self.failures, "last_error": self.last_error,
        }


def describe(exc: BaseException) -> str:
    """An exception as one status line: its type and message, cut to ERROR_CHARS."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return " ".join(text.split())[:ERROR_CHARS]


class Tracker:
    """One loop's outcomes. The loop calls :meth:`ok` or :meth:`failed` once per turn."""

    def __init__(self, name: str, *, critical: bool = True) -> None:
        self._lock = threading.Lock()
        self._now = LoopHealth(name, critical=critical)

    @property
    def health(self) -> LoopHealth:
        return self._now

    def ok(self, now: float) -> None:
        with self._lock:
            self._now = replace(self._now, last_ok=now, consecutive_failures=0)

    def failed(self, now: float, error: BaseException | str) -> None:
        # Redacted here, where every reader passes: git's errors can carry a URL's token.
        why = redact(error if isinstance(error, str) else describe(error))
        with self._lock:
            h = self._now
            self._now = replace(h, last_failure=now, consecutive_failures=h.consecutive_failures + 1,
                                failures=h.failures + 1, last_error=why[:ERROR_CHARS])


@dataclass(frozen=True)
class Health:
    """Every loop of a controller at one moment."""

    loops: tuple[LoopHealth, ...]

    @classmethod
    def of(cls, trackers: Iterable[Tracker]) -> Health:
        return cls(tuple(t.health for t in trackers))

    @property
    def state(self) -> str:
        """The worst loop's state ("ok" when there are none)."""
        order = ("ok", "degraded", "unhealthy")
        return max((h.state for h in self.loops), key=order.index, default="ok")

    @property
    def fit(self) -> bool:
        """False when a critical loop is unhealthy: what a liveness probe should act on."""
        return not any(h.critical and h.state == "unhealthy" for h in self.loops)

    def problems(self) -> list[str]:
        """One line per failing loop, for status and the dashboard."""
        out = []
        for h in self.loops:
            if h.consecutive_failures:
                times = "once" if h.consecutive_failures == 1 else f"{h.consecutive_failures} times in a row"
                out.append(f"{h.name} {h.state}: failed {times}: {h.last_error}")
        return out

    def to_json(self) -> dict[str, object]:
        return {"state": self.state, "fit": self.fit, "loops": [h.to_json() for h in self.loops]}
