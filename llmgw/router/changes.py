"""A "something changed" signal that any thread may raise and event-loop tasks may wait on.

The endpoint table and the catalog are pushed by the control plane, which may call from its own
thread (a git watcher) or from the event loop (the reconciler). Waiters — held requests, watch
streams — take the current event and wait on it; a change sets it and puts a fresh one in its
place, so nobody ever waits on an event that was already set.
"""

from __future__ import annotations

import asyncio


class Changes:
    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop whose tasks wait; changes from other threads are handed to it."""
        self._loop = loop

    @property
    def event(self) -> asyncio.Event:
        """Take this *before* checking the state, then wait on it: no change can slip between."""
        return self._event

    def notify(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            self._fire()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._fire()
        else:
            try:
                loop.call_soon_threadsafe(self._fire)
            except RuntimeError:  # the loop closed between the check and the call
                self._fire()

    def _fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()
