"""Engine queue depth for selection: each replica's ``/metrics``, read on a short interval.

The router's own in-flight counts see only its own requests; with several routers (or clients
going straight to an engine) an engine can be busy with work this router never sent. So every
``interval`` seconds each replica in the table has its running + waiting counts read, and what
exceeds this router's own in-flight is kept as that replica's outside load. Nothing is read
while the table is empty, and a replica whose metrics cannot be read keeps its last figure
(a failing engine is the retry path's business, not this one's).

vLLM's ``/metrics`` runs to ~100 KB of histograms, so the two gauges are found by scanning
the text for their names instead of parsing every family: this runs on the router's core.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from llmgw.engines.health import LOAD_METRICS, read_load
from llmgw.router.table import EndpointTable, Upstream

log = logging.getLogger(__name__)


async def read_queue(session: aiohttp.ClientSession, up: Upstream) -> tuple[int, int] | None:
    """(running, waiting) on one replica's engine, through the same reader the probes use."""
    if up.endpoint.engine not in LOAD_METRICS:
        return None
    load = await read_load(session, up.url, up.endpoint.engine)
    return None if load is None else (load.running, load.waiting)


async def poll_loads(table: Callable[[], EndpointTable], session: aiohttp.ClientSession, interval: float) -> None:
    """Refresh every replica's outside load forever (cancel to stop)."""
    while True:
        ups = list(table().upstreams.values())
        if ups:
            before = [u.inflight for u in ups]
            results = await asyncio.gather(*(read_queue(session, u) for u in ups))
            for u, mine, queue in zip(ups, before, results, strict=True):
                if queue is not None:
                    # The engine's count includes this router's requests of the moment it was
                    # read; taking the larger of before/after never invents outside load.
                    u.external = max(0, queue[0] + queue[1] - max(mine, u.inflight))
        await asyncio.sleep(interval)
