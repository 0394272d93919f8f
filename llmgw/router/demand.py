"""Demand the router reports to the control plane, and holding requests for a model at zero.

Per model, ``held`` counts (a) requests waiting here for a replica to start, (b) requests a
fallback is serving in the model's place, and (c) — for ``linger`` seconds after the last
such request — 1 while the model still has no replica. (c) is what lets a fallback answer
at once while the primary is still woken: the control plane reads the snapshot on its own
tick, by which time the fallback's answer may long be done. ``inflight`` is read from the
endpoint table by the caller.

The control plane is woken through ``wake(model_name)`` at most once a second per model, so a
burst of requests for a cold model is one wake-up, not thousands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from llmgw.contract import Demand
from llmgw.router.changes import Changes

WAKE_EVERY = 1.0  # seconds between wake-ups for one model


class DemandBook:
    def __init__(self, changes: Changes, *, clock: Callable[[], float], linger: float) -> None:
        self.wake: Callable[[str], None] | None = None
        self.changes = changes
        self.clock = clock
        self.linger = linger
        self.held: dict[str, int] = {}
        self.held_total = 0
        self._standin: dict[str, int] = {}
        self._wanted_until: dict[str, float] = {}
        self._woken_at: dict[str, float] = {}

    def want(self, model: str) -> None:
        """A request needed ``model`` and found no replica: remember it, wake the control plane."""
        now = self.clock()
        self._wanted_until[model] = now + self.linger
        if self.wake is not None and now - self._woken_at.get(model, -1e9) >= WAKE_EVERY:
            self._woken_at[model] = now
            self.wake(model)

    @contextmanager
    def standing_in(self, model: str) -> Iterator[None]:
        """A fallback serves a request for ``model`` for the duration."""
        self.want(model)
        _add(self._standin, model, 1)
        try:
            yield
        finally:
            _add(self._standin, model, -1)

    async def hold(self, model: str, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` (checked on every table or catalog change) or ``timeout``;
        True when it became ready. Counted as held meanwhile."""
        _add(self.held, model, 1)
        self.held_total += 1
        self.want(model)
        deadline = self.clock() + timeout
        try:
            while True:
                event = self.changes.event
                if ready():
                    return True
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    return ready()
        finally:
            self.held_total -= 1
            _add(self.held, model, -1)

    def snapshot(self, inflight: dict[str, int], has_replica: Callable[[str], bool]) -> dict[str, Demand]:
        now = self.clock()
        held: dict[str, int] = {}
        for m, n in (*self.held.items(), *self._standin.items()):
            held[m] = held.get(m, 0) + n
        for m, until in list(self._wanted_until.items()):
            if until < now or has_replica(m):
                del self._wanted_until[m]
            elif not held.get(m):
                held[m] = 1
        return {m: Demand(held=held.get(m, 0), inflight=inflight.get(m, 0)) for m in {*held, *inflight}}


def _add(counts: dict[str, int], key: str, n: int) -> None:
    total = counts.get(key, 0) + n
    if total:
        counts[key] = total
    else:
        del counts[key]
