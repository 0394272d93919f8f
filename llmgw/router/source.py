"""The router as the control plane's usage source (:class:`~llmgw.contract.UsageSource`).

Everything the controller, the admin API and the usage ledger read back from a router goes
through :class:`RouterUsage`: when each replica was last used, what is in flight on it, demand,
prompt-cache hits and canary measurements per model or replica, and the outbox of usage rows by
minute. In the controller's process it is read directly (merged with standalone routers' reports,
:class:`llmgw.control.feed.MergedUsage`); a standalone router sends the same readings in its
reports (:mod:`llmgw.router.follow`). The request path writes the books these read
(:mod:`llmgw.router.account`, the endpoint table, :mod:`llmgw.router.demand`) and never this.

Kept apart from :class:`~llmgw.router.app.Router` so the wiring is not also the reporting: a
caller that only reads usage holds this object, not the server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable

from llmgw.contract import Demand, PromptCache, ReplicaStats
from llmgw.router.account import Accounting
from llmgw.router.current import Current
from llmgw.router.demand import DemandBook
from llmgw.router.table import Upstream
from llmgw.tenancy.usage import UsageOutbox


class RouterUsage:
    """One router's readings; every call returns copies the caller may keep."""

    reads_engines = True  # every replica in its table, every load_interval (llmgw.router.load)

    def __init__(self, current: Current, accounting: Accounting, demand: DemandBook) -> None:
        self._current = current
        self._accounting = accounting
        self._demand = demand
        # Replicas taken out of the table with requests still in flight: the controller waits
        # for those to end before it stops the engine (in_flight_by_replica), so it must still
        # see them. One entry per Upstream, not per replica id: a replica withdrawn, listed again
        # and withdrawn again has two, each with its own requests.
        self._leaving: list[Upstream] = []
        # A process's id in canary readings: a restarted router is a new instance, never a reset.
        self.instance_id = accounting.instance_id
        # The counts by minute, until the controller's ledger has them (llmgw.contract).
        self.outbox: UsageOutbox = accounting.usage.outbox
        # Reads the engines of some models now (set while the router runs: llmgw.router.load).
        self.read_engines_now: Callable[[Collection[str]], Awaitable[None]] | None = None

    def withdrawn(self, upstreams: Iterable[Upstream]) -> None:
        """Replicas just taken out of the table: those with requests in flight go on counting
        until the requests end. Ended ones are dropped here too, so the list is bounded by what is
        in flight whether or not anyone reads it."""
        self._leaving = [u for u in (*self._leaving, *upstreams) if u.inflight > 0]

    def last_used(self) -> dict[str, float]:
        """Unix time each replica last had a request start or finish."""
        return dict(self._accounting.last_used)

    def in_flight_by_replica(self) -> dict[str, int]:
        """This router's requests in flight per replica id, those of replicas already withdrawn
        from the table included until they end."""
        table = self._current.table
        out = {rid: u.inflight for rid, u in table.upstreams.items() if u.inflight > 0}
        self._leaving = [u for u in self._leaving if u.inflight > 0]
        for u in self._leaving:
            if table.upstreams.get(u.replica_id) is not u:  # not counted above already
                out[u.replica_id] = out.get(u.replica_id, 0) + u.inflight
        return out

    def engine_queue(self) -> dict[str, tuple[int, int]]:
        """(running, waiting) per replica as its engine last reported (:mod:`llmgw.router.load`)."""
        return {rid: u.engine_load for rid, u in self._current.table.upstreams.items() if u.engine_load is not None}

    def engine_tokens(self) -> dict[str, tuple[str, float | None, float | None]]:
        """Per replica, its model and the prompt and generated tokens its engine counted since it
        started, as last read: what bounds the usage routers report (llmgw.decide.usage_gate)."""
        return {rid: (u.model, *u.engine_tokens) for rid, u in self._current.table.upstreams.items()
                if u.engine_tokens is not None}

    async def engine_tokens_now(self, models: Collection[str]) -> None:
        """Read the engines of ``models`` now, so :meth:`engine_tokens` says what they counted by
        this moment (the usage gate, before it holds a batch the last reading does not cover)."""
        if self.read_engines_now is not None:
            await self.read_engines_now(models)

    def demand(self) -> dict[str, Demand]:
        """Held and in-flight requests per model (see :mod:`llmgw.router.demand`)."""
        table = self._current.table
        inflight: dict[str, int] = {}
        for u in table.upstreams.values():
            if u.inflight:
                inflight[u.model] = inflight.get(u.model, 0) + u.inflight
        return self._demand.snapshot(inflight, table.has)

    def prompt_cache(self, *, polled: bool = True) -> dict[str, PromptCache]:
        """Per model, how prompts met cached prefixes since this router started. ``polled=False``
        leaves out what was read from engines' own counters (a standalone router's report: the
        controller's router reads those engines too, and reports are summed)."""
        return self._accounting.prompt_cache(polled=polled)

    def replica_stats(self) -> dict[str, dict[str, ReplicaStats]]:
        """``{instance_id: {replica id: stats}}``, what this router measured of each replica in the
        table since it started (cumulative), as copies: the live counters go on moving while the
        caller takes differences."""
        return self._accounting.replica_stats()
