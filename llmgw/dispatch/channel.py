"""Requests and answers multiplexed by id over one long-lived agent process (``serve`` mode).

Opening an SSH exec session costs ~170 ms on a typical host and a round trip on an open channel
~1.5 ms, so every call is a line on a channel that stays open, never a session of its own.
:class:`PendingCalls` is the bookkeeping both transports share: it hands out ids, matches answer
lines to waiting futures, and fails everything still waiting when the agent goes away, so no
caller waits on an answer that can no longer come.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable

from llmgw.dispatch.base import Answer
from llmgw.errors import DispatchError

log = logging.getLogger(__name__)


class NoAnswer(Exception):
    """A call got no answer in time; ``silent`` when the agent said nothing at all since it was sent
    (a hung node, whose connection should go) rather than being slow on this one request."""

    def __init__(self, silent: bool) -> None:
        super().__init__()
        self.silent = silent


class PendingCalls:
    """Calls sent on one agent channel and not answered yet. Event-loop thread only."""

    def __init__(self, node_id: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id = node_id
        self._clock = clock
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Answer]] = {}
        self._failed: DispatchError | None = None
        self.last_rx = clock()  # when the agent last said anything: tells a hung node from a slow verb

    def add(self) -> tuple[int, asyncio.Future[Answer]]:
        """A fresh id and the future its answer will resolve; raises at once if the channel died."""
        if self._failed is not None:
            raise type(self._failed)(str(self._failed))
        request_id = next(self._ids)
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return request_id, future

    def now(self) -> float:
        return self._clock()

    def queued_behind(self, request_id: int) -> bool:
        """Whether a call sent before ``request_id`` is still waiting. The agent runs a bounded
        number of calls at once, so a call may sit queued behind slow ones (``stop`` waiting out
        its grace period): its silence then says nothing about the node being hung."""
        return any(other < request_id for other in self._waiting)

    def discard(self, request_id: int) -> None:
        """Forget a call whose caller gave up; a late answer for it is then dropped."""
        self._waiting.pop(request_id, None)

    def feed(self, lines: Iterable[bytes]) -> None:
        """Resolve the futures whose answers are in ``lines`` (complete lines, newline stripped)."""
        self.last_rx = self._clock()
        for line in lines:
            if not line.strip():
                continue
            try:
                message = json.loads(line)
                request_id = message["id"]
            except (ValueError, KeyError, TypeError):
                log.warning("%s: agent wrote a line that is not an answer: %.200r", self.node_id, line)
                continue
            future = self._waiting.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(message)

    def fail_all(self, error: DispatchError) -> None:
        """The channel is gone: every waiting call and every later ``add`` fails with ``error``."""
        self._failed = error
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(type(error)(str(error)))

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def __len__(self) -> int:
        return len(self._waiting)


def split_lines(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append ``data`` to ``buffer`` and pop every complete line out of it."""
    buffer += data
    if b"\n" not in data:
        return []
    *lines, rest = bytes(buffer).split(b"\n")
    buffer[:] = rest
    return lines
