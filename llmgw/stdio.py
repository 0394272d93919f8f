"""Standard output and error that cannot stop a serving process (DESIGN §6: INT, TERM, HUP).

`llmgw up 2>&1 | tee up.log`, then Ctrl-C: the terminal signals its whole foreground group, so
tee exits too, and up's "stopping…" line met a closed pipe. rich answers a BrokenPipeError by
raising SystemExit(1), which left the shutdown before it stopped anything: every engine, its
sandbox and its monitor kept running. A reader that stops reading (a paused pager, a stuck log
shipper) is worse: a write blocks, and with it the event loop, the router, and any shutdown. A
closed terminal (writes fail with EIO) is a closed pipe again.

So a serving process writes its output through :func:`guard`: the process's ``sys.stdout`` and
``sys.stderr`` become queues that a thread per destination empties. A write never blocks and
never raises; output a reader does not take is kept up to a bound, then dropped and counted (a
note says how much, once the reader is back); a destination that failed is given up for good.
Commands whose output is their product (``-o json``) keep ordinary blocking streams.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import select
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TextIO

# A few minutes of a busy controller's log at info level: more is dropped, not held.
QUEUE_LIMIT = 1 << 20
# How long the end of a process waits for its last lines (the "stopped" line) to get out.
EXIT_DRAIN = 2.0


@dataclass
class _Dropped:
    """Where output was dropped in the stream, and how much."""

    writes: int = 0
    nbytes: int = 0

    def note(self) -> bytes:
        return (f"[llmgw: {self.writes} writes ({self.nbytes} bytes) of output dropped here: "
                "nothing was reading it]\n").encode()


@dataclass
class Pump:
    """One destination (a pipe, a terminal, a file) and the thread that writes to it."""

    fd: int
    limit: int = QUEUE_LIMIT
    _items: deque[bytes | _Dropped] = field(default_factory=deque)
    _queued: int = 0  # bytes in _items, and in the write under way
    _busy: bool = False
    failed: OSError | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None

    def put(self, data: bytes) -> None:
        """Queue ``data``; never blocks, never raises."""
        if not data:
            return
        with self._cond:
            if self.failed is not None:
                return
            if self._queued + len(data) > self.limit:
                last = self._items[-1] if self._items else None
                if not isinstance(last, _Dropped):
                    last = _Dropped()
                    self._items.append(last)
                last.writes += 1
                last.nbytes += len(data)
            else:
                self._items.append(data)
                self._queued += len(data)
            if self._thread is None:
                # Daemon: a thread stuck in write() on a full pipe must not keep the process alive.
                self._thread = threading.Thread(target=self._run, name=f"llmgw-stdio-{self.fd}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for everything queued to be written (or given up)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.failed is not None or not (self._items or self._busy), timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._items))
                item = self._items.popleft()
                self._busy = True
            data = item.note() if isinstance(item, _Dropped) else item
            try:
                _write_all(self.fd, data)
            except OSError as exc:  # EPIPE (the reader left), EIO (the terminal closed), ENOSPC…
                with self._cond:
                    self.failed = exc
                    self._items.clear()
                    self._queued = 0
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                if not isinstance(item, _Dropped):
                    self._queued -= len(item)
                self._cond.notify_all()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # someone made the descriptor non-blocking: wait until it takes more
            select.select([], [fd], [])
            continue
        view = view[n:]


class _Sink(io.RawIOBase):
    """The binary end of a guarded stream: a write is a put on its pump."""

    def __init__(self, pump: Pump, fd: int) -> None:
        super().__init__()
        self.pump = pump
        self.fd = fd

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # any bytes-like (BufferedWriter passes memoryviews)
        chunk = bytes(data)
        self.pump.put(chunk)
        return len(chunk)

    def fileno(self) -> int:
        return self.fd  # rich and os.isatty ask which terminal this is; the descriptor is never closed here

    def isatty(self) -> bool:
        try:
            return os.isatty(self.fd)
        except OSError:
            return False


@dataclass
class Guard:
    """The guarded standard streams of this process; :meth:`drain` waits a bounded time."""

    pumps: list[Pump]

    def drain(self, timeout: float = EXIT_DRAIN) -> bool:
        """Give queued output up to ``timeout`` seconds in all to get out; True when it did."""
        import time

        deadline = time.monotonic() + timeout
        return all(p.drain(max(0.0, deadline - time.monotonic())) for p in self.pumps)


_installed: Guard | None = None


def guard(*, limit: int = QUEUE_LIMIT) -> Guard | None:
    """Route this process's ``sys.stdout`` and ``sys.stderr`` through pumps (once per process).

    Call it before logging is configured (a handler keeps the stream it was given). Streams
    already replaced by someone else (pytest's capture, a test's StringIO) are left alone: they
    are not a pipe or a terminal this process could be stopped by. Returns None then.
    """
    global _installed  # the process's own standard streams are process-global by nature
    if _installed is not None:
        return _installed
    out, err = sys.__stdout__, sys.__stderr__
    if out is None or err is None or sys.stdout is not out or sys.stderr is not err:
        return None  # no descriptor 1 or 2 at all, or streams someone else owns
    olds: tuple[TextIO, TextIO] = (out, err)
    pumps: dict[tuple[int, int], Pump] = {}
    streams: list[TextIO] = []
    for old in olds:
        with contextlib.suppress(OSError, ValueError):
            old.flush()
        fd = old.fileno()
        st = os.fstat(fd)
        # stdout and stderr on one pipe (`2>&1`) share one pump, so their lines keep their order.
        pump = pumps.setdefault((st.st_dev, st.st_ino), Pump(fd, limit=limit))
        streams.append(io.TextIOWrapper(io.BufferedWriter(_Sink(pump, fd)), encoding=old.encoding,
                                        errors="backslashreplace", line_buffering=True))
    sys.stdout, sys.stderr = streams
    _installed = Guard(list(pumps.values()))
    atexit.register(_installed.drain)
    return _installed
