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
import itertools
import logging
from collections.abc import Callable, Collection

import aiohttp

from llmgw.bounded import remember
from llmgw.engines.health import LOAD_METRICS, Load, read_load
from llmgw.router.table import EndpointTable, Upstream

# Called with a replica and the prompt tokens its engine looked up in, and found in, its prefix
# cache since the last reading (engines that count them: vLLM).
PrefixCounts = Callable[[Upstream, float, float], None]

log = logging.getLogger(__name__)


async def read_engine(session: aiohttp.ClientSession, up: Upstream) -> Load | None:
    """One replica's engine :class:`Load`, through the same reader the probes use."""
    if up.endpoint.engine not in LOAD_METRICS:
        return None
    return await read_load(session, up.url, up.endpoint.engine)


def apply_load(u: Upstream, mine: int, load: Load, prefix_counts: PrefixCounts | None) -> None:
    """One replica's reading: its outside load, and how far its prefix-cache counters moved."""
    # The engine's count includes this router's requests of the moment it was read; taking the
    # larger of before/after never invents outside load.
    u.external = max(0, load.running + load.waiting - max(mine, u.inflight))
    u.engine_load = (int(load.running), int(load.waiting))
    if load.generated is not None or load.prompted is not None:
        u.engine_tokens = (load.prompted, load.generated)
    if load.prefix_queries is None or load.prefix_hits is None:
        return
    totals = (load.prefix_queries, load.prefix_hits)
    last, u.prefix_totals = u.prefix_totals, totals
    if last is None:
        return  # the first reading is the engine's history before this router
    if totals[0] < last[0]:
        u.forget_prompts()  # counting from zero again: a restarted engine, with an empty cache
    elif prefix_counts is not None:
        prefix_counts(u, totals[0] - last[0], max(0.0, totals[1] - last[1]))


class LoadReader:
    """Reads every replica's engine into its :class:`Upstream`: every ``interval`` seconds
    (:meth:`run`), and at once for the replicas of some models (:meth:`read_now`: the usage gate's
    fresh look before it holds a router's batch). Readings may overlap (the poll and a read at
    once); each is stamped when it begins, and one that answers after a later-begun one was
    applied is dropped: applied over it, counters would go backwards, which reads as an engine
    restarted, and the usage gate would count the engine's whole past again. A reading that cannot
    be applied calls ``odd`` (the router counts it in a metric) and is logged once per replica
    until that replica reads well again: every poll of every replica used to log its traceback."""

    def __init__(self, table: Callable[[], EndpointTable], session: aiohttp.ClientSession,
                 prefix_counts: PrefixCounts | None = None, odd: Callable[[Upstream], None] | None = None) -> None:
        self.table = table
        self.session = session
        self.prefix_counts = prefix_counts
        self.odd = odd
        self._odd_now: set[str] = set()
        self._stamps = itertools.count(1)
        self._asked: dict[str, float] = {}  # per model, when read_now last began reading it (loop time)
        self._reading: dict[str, asyncio.Task[None]] = {}  # per model, read_now's reading under way

    async def read(self, ups: list[Upstream]) -> None:
        """One reading of each of ``ups``, together."""
        stamps = [next(self._stamps) for _ in ups]
        before = [u.inflight for u in ups]
        results = await asyncio.gather(*(read_engine(self.session, u) for u in ups))
        for u, stamp, mine, load in zip(ups, stamps, before, results, strict=True):
            if stamp < u.read_stamp:
                continue  # a reading begun after this one was applied already
            u.read_stamp = stamp
            if load is None:
                # Its outside load stays (routing keeps the last figure), but the queue an
                # operator sees is the engine's word now or nothing: never a hung engine's old one.
                u.engine_load = None
                continue
            try:
                apply_load(u, mine, load, self.prefix_counts)
            except Exception:  # noqa: BLE001 - one odd reading must not stop the readings of every replica
                if self.odd is not None:
                    self.odd(u)
                if u.replica_id not in self._odd_now:
                    self._odd_now.add(u.replica_id)
                    log.exception("ignoring the load read from %s (said once until it reads well again)", u.url)
            else:
                self._odd_now.discard(u.replica_id)

    async def read_now(self, models: Collection[str]) -> None:
        """Read the engines of ``models`` now and return once read. A model read at once less than
        READ_NOW_EVERY ago is not read again (a router sending batches that never fit costs the
        engines one more reading a second at most, whoever sends them); one being read is waited for."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        under_way = {t for m in models if (t := self._reading.get(m)) is not None and not t.done()}
        due = {m for m in models
               if m not in self._reading and now - self._asked.get(m, -READ_NOW_EVERY) >= READ_NOW_EVERY}
        for m in due:
            remember(self._asked, m, now, MAX_ASKED)
        ups = [u for u in self.table().upstreams.values() if u.model in due]
        if ups:
            task = loop.create_task(self.read(ups), name="engine-read-now")
            for m in due:
                self._reading[m] = task
            task.add_done_callback(lambda t: self._read(due, t))
            under_way.add(task)
        if under_way:  # shielded: one caller cancelled does not cancel the reading the others wait for
            await asyncio.gather(*(asyncio.shield(t) for t in under_way), return_exceptions=True)

    def _read(self, models: set[str], task: asyncio.Task[None]) -> None:
        for m in models:
            if self._reading.get(m) is task:
                del self._reading[m]

    async def run(self, interval: float) -> None:
        """Read every replica in the table forever (cancel to stop); nothing while it is empty."""
        while True:
            if ups := list(self.table().upstreams.values()):
                await self.read(ups)
            await asyncio.sleep(interval)


READ_NOW_EVERY = 1.0  # seconds: as often again as the poll, at most
MAX_ASKED = 4096  # models whose last on-demand reading is remembered
