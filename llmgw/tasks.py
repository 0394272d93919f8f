"""Background tasks' end: every part that runs one stops it the same way."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(*tasks: asyncio.Task[object] | None) -> None:
    """Cancel ``tasks`` (None: none) and wait until each has ended, its cancellation swallowed."""
    running = [t for t in tasks if t is not None]
    for t in running:
        t.cancel()
    for t in running:
        with contextlib.suppress(asyncio.CancelledError):
            await t
