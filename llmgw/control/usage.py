"""The controller's side of the usage ledger: routers' batches into the store, once each.

Standalone routers send their batches with their reports (``FeedHub.report`` records them); the
router in the controller's own process hands its batches over here, through the same
``take``/``acked`` handshake, so there is one path into the ledger whoever counted the tokens.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable

from llmgw.contract import UsageLedger, UsageOutboxLike
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

COMPACT_EVERY = 3600.0


class UsageFlusher:
    """Moves ``outbox`` (the in-process router's) into ``ledger`` every ``interval`` and at close."""

    def __init__(self, outbox: UsageOutboxLike, ledger: UsageLedger, *, interval: float = 2.0,
                 compact: Callable[[], object] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.outbox = outbox
        self.ledger = ledger
        self.interval = interval
        self.compact = compact
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._compacted = clock()
        self._failing = False

    def flush(self) -> None:
        """Record what the router counted; a failure keeps the batch for the next try."""
        batch = self.outbox.take()
        if batch is None:
            return
        try:
            self.ledger.record_usage(batch)
        except sqlite3.Error as exc:  # a full disk, a locked database: counted again next time
            if not self._failing:
                log.warning("usage ledger: could not record %d rows (%s); will keep trying", len(batch.rows), exc)
            self._failing = True
            return
        self._failing = False
        self.outbox.acked(batch.seq)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-flush")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.flush()
            if self.compact is not None and self.clock() - self._compacted >= COMPACT_EVERY:
                self._compacted = self.clock()
                try:
                    self.compact()
                except sqlite3.Error as exc:
                    log.warning("usage ledger: compaction failed (%s)", exc)

    async def close(self) -> None:
        """Stop, after one last flush (call it after the router drained: its last answers count)."""
        await cancel_and_wait(self._task)
        self._task = None
        self.flush()
