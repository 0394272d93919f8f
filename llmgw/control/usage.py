"""The controller's side of the usage ledger: routers' batches into the store, once each, and
what each budget has used this period (:class:`BudgetBook`), for every router.

Standalone routers send their batches with their reports (``FeedHub.report`` records them); the
router in the controller's own process hands its batches over here, through the same
``take``/``acked`` handshake, so there is one path into the ledger whoever counted the tokens.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.catalog import Catalog
from llmgw.catalog.model import Budget, Tenant
from llmgw.contract import SpentFigures, UsageBatch, UsageLedger, UsageOutboxLike, next_period, period_start
from llmgw.decide.usage_gate import HOLD, EngineCounts, UsageGate
from llmgw.errors import StoreError
from llmgw.health import Tracker, describe
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

COMPACT_EVERY = 3600.0


class UsageQueries(Protocol):
    def usage(self, since: float, until: float, *, by: tuple[str, ...] = ...) -> list[dict[str, Any]]: ...


@dataclass
class _Spent:
    budget: Budget
    period: float = -1.0  # start of the period ``tokens`` belong to; -1: not read from the ledger yet
    tokens: int = 0
    refused: int = 0  # requests the tenant's limits refused in the period (for the operator, not the limits)
    loading: bool = False


class BudgetBook:
    """What each budget scope (a tenant's budget, a tenant's budget for one model) used in its
    current period, per the ledger: read from the store once per scope (:meth:`load`, at start
    and for a budget that is new or changed its period), then kept up to date from every batch
    recorded (:meth:`recorded`), so telling the routers costs no query.

    Rows recorded while a scope is being read are added to what the read returns: a row that the
    read also saw is counted twice, an overcount bounded by what arrives during one read (a
    tenant refused a little early, never one let past its budget).
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()  # catalogs may arrive from the follower's thread
        self._scopes: dict[tuple[str, str], _Spent] = {}
        self.version = 0  # changes whenever a figure may have
        self._loading: asyncio.Task[None] | None = None
        # Called (on the event loop, outside the lock) when figures changed: the controller's own
        # router hears at once, not only at its next flush.
        self.on_change: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop on_change runs on (set by load)

    def set_catalog(self, catalog: Catalog) -> None:
        """Catalog subscriber: the budgets to follow (a budget whose period changed is read again)."""
        self.set_tenants(catalog.settings.tenants)

    def set_tenants(self, tenants: Iterable[Tenant]) -> None:
        wanted: dict[tuple[str, str], Budget] = {}
        for t in tenants:
            if t.limits.budget is not None:
                wanted[(t.name, "")] = t.limits.budget
            for m, lim in t.models:
                if lim.budget is not None:
                    wanted[(t.name, m)] = lim.budget
        with self._lock:
            scopes = {}
            for k, b in wanted.items():
                old = self._scopes.get(k)
                if old is not None and (old.budget.per, old.budget.reset) == (b.per, b.reset):
                    old.budget = b
                    scopes[k] = old
                else:
                    scopes[k] = _Spent(b)
            self._scopes = scopes
            self.version += 1
            loop, fresh = self._loop, any(s.period < 0 for s in scopes.values())
        if fresh and loop is not None and self.on_change is not None:
            # A budget new in the catalog is read at once, not at the next flush: until then its
            # figure is unknown, and a router restarted meanwhile would start from nothing.
            loop.call_soon_threadsafe(self.on_change)

    @property
    def loaded(self) -> bool:
        """Every scope has been read from the ledger (before that, a figure would say too little)."""
        with self._lock:
            return all(s.period >= 0 and not s.loading for s in self._scopes.values())

    async def load(self, store: UsageQueries) -> bool:
        """Read, in a thread, what the scopes not read yet used this period; False when there
        was none to read (or another load is reading them)."""
        self._loop = asyncio.get_running_loop()
        now = self.clock()
        with self._lock:
            todo = [(k, s) for k, s in self._scopes.items() if s.period < 0 and not s.loading]
            for _, s in todo:
                s.loading, s.period, s.tokens, s.refused = True, period_start(s.budget, now), 0, 0
        if not todo:
            return False
        try:
            sums = await asyncio.to_thread(_spent_since, store, {s.period for _, s in todo})
        except BaseException:
            with self._lock:
                for _, s in todo:
                    s.loading, s.period = False, -1.0
            raise
        with self._lock:
            for k, s in todo:
                s.loading = False
                tokens, refused = sums.get(s.period, {}).get(k, (0, 0))
                s.tokens += tokens
                s.refused += refused
            self.version += 1
        if self.on_change is not None:
            self.on_change()
        return True

    def load_soon(self, store: UsageQueries) -> None:
        """Start :meth:`load` for budgets new since the last (one at a time), without waiting."""
        if self._loading is None or self._loading.done():
            self._loading = asyncio.get_running_loop().create_task(self._load_logged(store), name="budget-load")

    async def _load_logged(self, store: UsageQueries) -> None:
        try:
            while await self.load(store) and not self.loaded:
                pass  # budgets new in a catalog that came while reading the others
        except StoreError as exc:  # tried again at the next flush; meanwhile routers keep their own counts
            log.warning("usage ledger: could not read what budgets used (%s); will try again", exc)

    def recorded(self, batch: UsageBatch) -> None:
        """A batch just recorded in the ledger: its tokens count against the budgets they fall in."""
        changed = False
        now = self.clock()
        with self._lock:
            for r in batch.rows:
                tokens = r.prompt_tokens + r.completion_tokens
                if not tokens and not r.refused:
                    continue
                for k in ((r.tenant, ""), (r.tenant, r.model)) if r.model else ((r.tenant, ""),):
                    s = self._scopes.get(k)
                    if s is None or s.period < 0:
                        continue
                    # A row stamped ahead of this clock (a router's clock skewed) counts in the
                    # current period: moving the scope into a period not begun would tell every
                    # router it used next to nothing, and a Redis restarted empty would hand out
                    # a fresh budget.
                    start = min(period_start(s.budget, r.minute), period_start(s.budget, now))
                    if start == s.period:
                        s.tokens += tokens
                        s.refused += r.refused
                    elif start > s.period and not s.loading:  # the first use of a new period
                        s.period, s.tokens, s.refused = start, tokens, r.refused
                    else:
                        continue
                    changed = changed or bool(tokens)  # the routers hear of tokens; refusals are the view's
            if changed:
                self.version += 1
        if changed and self.on_change is not None:
            self.on_change()

    def view(self) -> list[dict[str, Any]]:
        """Each budget, for `llmgw usage`, the admin API and the dashboard: its size, what it used
        this period per the ledger, what is left, when it resets and how many requests the tenant's
        limits refused in the period (used and refused null: not read yet)."""
        now = self.clock()
        figures = self.figures()
        with self._lock:
            scopes = {k: (s.budget, s.refused) for k, s in self._scopes.items()}
        out = []
        for (tenant, model), (budget, refused) in sorted(scopes.items()):
            used = figures[(tenant, model)][1] if (tenant, model) in figures else None
            out.append({"tenant": tenant, "model": model or None, "tokens": budget.tokens, "per": budget.per,
                        "used": used, "left": max(0, budget.tokens - used) if used is not None else None,
                        "resets_at": next_period(budget, now), "refused": refused if used is not None else None})
        return out

    def figures(self) -> SpentFigures:
        """(tenant, model or "") → (period start, tokens used in it), for the scopes read so far."""
        now = self.clock()
        with self._lock:
            out = {}
            for k, s in self._scopes.items():
                if s.period < 0 or s.loading:
                    continue
                start = period_start(s.budget, now)
                if start > s.period:  # a new period began: nothing used in it yet
                    s.period, s.tokens, s.refused = start, 0, 0
                out[k] = (s.period, s.tokens)
            return out


def _spent_since(store: UsageQueries, starts: set[float]) -> dict[float, dict[tuple[str, str], tuple[int, int]]]:
    """For each period start: (tokens, refusals) per (tenant, model) and per (tenant, "") since then
    (a refusal before the body was read has model "": the tenant's alone)."""
    out: dict[float, dict[tuple[str, str], tuple[int, int]]] = {}
    for start in starts:
        sums: dict[tuple[str, str], tuple[int, int]] = {}
        for row in store.usage(start, 2 ** 40, by=("tenant", "model")):
            tokens, refused = int(row["prompt_tokens"]) + int(row["completion_tokens"]), int(row["refused"])
            whole = sums.get((row["tenant"], ""), (0, 0))
            if row["model"]:
                sums[(row["tenant"], row["model"])] = (tokens, refused)
            sums[(row["tenant"], "")] = (whole[0] + tokens, whole[1] + refused)
        out[start] = sums
    return out


class BookedLedger:
    """The ledger, with every batch it records also counted in ``book``: one path for the
    standalone routers' batches (the feed hub) and the controller's own router's (the flusher)."""

    def __init__(self, ledger: UsageLedger, book: BudgetBook) -> None:
        self.ledger = ledger
        self.book = book

    def record_usage(self, batch: UsageBatch) -> bool:
        recorded = self.ledger.record_usage(batch)
        if recorded:
            self.book.recorded(batch)
        return recorded

    def usage_seq(self, instance: str) -> int:
        return self.ledger.usage_seq(instance)


class UsageDeferred(Exception):
    """A router's usage batch waits for the engines' counts: not recorded, not acknowledged.
    ``models``: those whose engines' counts it waits for; ``first``: it did not wait before."""

    def __init__(self, message: str, models: frozenset[str] = frozenset(), *, first: bool = False) -> None:
        super().__init__(message)
        self.models = models
        self.first = first


SAVE_EVERY = 10.0  # seconds between writes of the gate's figures to the store


class GatedLedger:
    """The ledger for standalone routers' batches, behind a :class:`~llmgw.decide.usage_gate.UsageGate`
    (issue 41): the tokens all routers report for a model may not pass what its engines counted,
    as the controller's own router reads them (``readings``: per replica, its model and its
    engine's prompt and generation counters, None where not read; no callable: every row believed).
    ``models``: the catalog's model names (tokens for another model no engine was read for are
    taken for none). ``state``: where its figures are kept across restarts and leaders (load, keep;
    without them a new controller counted every engine's whole past as room for routers' rows).
    :attr:`trusted` is the same ledger for the controller's own router: recorded as it comes, and counted."""

    def __init__(self, inner: UsageLedger,
                 readings: Callable[[], Mapping[str, tuple[str, float | None, float | None]]] | None = None,
                 *, models: Callable[[], Collection[str] | None] | None = None,
                 state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.inner = inner
        self.readings = readings
        self.models = models
        self.state = state
        self.clock = clock
        self.gate = UsageGate()
        self.counts = EngineCounts()
        self.trusted = _Counted(self)
        self._saved_at = 0.0
        # The kept figures could not be read: routers' batches wait, and nothing is written over
        # the kept figures, until they are. Started anew instead, the engines' whole past was room
        # for routers' rows, and the next save lost the kept figures for good.
        self._unread = False
        self.reload()

    def reload(self) -> None:
        """The figures as last kept (at start, and when this controller takes the lead)."""
        if self.state is None:
            return
        try:
            kept = self.state[0]()
        except StoreError as exc:
            if not self._unread:
                log.warning("usage gate: its figures were not read from the store (%s): routers' usage waits "
                            "until they are", exc)
            self._unread = True
            return
        self._unread = False
        if isinstance(kept, dict):
            self.counts = EngineCounts.from_json(kept.get("counts"))
            self.gate.restore_reported(kept.get("reported"))

    def record_usage(self, batch: UsageBatch) -> bool:
        """As the ledger's, or :class:`UsageDeferred`: the batch waits for the engines' counts (not
        acknowledged, so its router sends it again; nothing of it is lost if this controller dies)."""
        if self._unread:
            self.reload()
            if self._unread:
                raise UsageDeferred("the usage gate's figures are not read from the store yet")
        known = self.models() if self.models is not None else None
        if self.models is not None and known is None:
            # No catalog yet (a git restore not done): which models are served is not known, and
            # past HOLD a made-up model's rows would be believed. The batch waits for a catalog.
            raise UsageDeferred("no catalog yet: usage waits for one")
        self._read()
        router = batch.instance.split("/")[0]
        first = (batch.instance, batch.seq) not in self.gate.waiting
        verdict = self.gate.admit(batch.rows, self.counts, router=router, instance=batch.instance, seq=batch.seq,
                                  now=self.clock(), known=known)
        if verdict.wait:
            if batch.seq <= self.inner.usage_seq(batch.instance):
                self.gate.waiting.pop((batch.instance, batch.seq), None)
                return False  # recorded before (its answer was lost): acknowledged again, not held up
            raise UsageDeferred(f"batch {batch.seq} of {batch.instance} waits for the engines' counts of "
                                f"{', '.join(sorted(verdict.waits_for))}", verdict.waits_for, first=first)
        recorded = self.inner.record_usage(replace(batch, rows=tuple(verdict.rows)))
        if recorded:  # (a batch recorded before: nothing of it is dropped or counted twice)
            self.gate.taken(verdict, router=router, instance=batch.instance, seq=batch.seq)
            for model, tokens in verdict.dropped.items():
                log.warning("usage ledger: %d tokens router %s reported for %s were dropped: the engines never "
                            "counted them (llmgw_controller_usage_unconfirmed_tokens)", tokens, router, model or '""')
        self.save()
        return recorded

    def usage_seq(self, instance: str) -> int:
        return self.inner.usage_seq(instance)

    def save(self, *, now: bool = False) -> None:
        """Keep the figures (every SAVE_EVERY seconds; ``now``: at once)."""
        if self.state is None or self._unread or (not now and self.clock() - self._saved_at < SAVE_EVERY):
            return
        self._saved_at = self.clock()
        try:
            self.state[1]({"counts": self.counts.to_json(), "reported": self.gate.reported_json()})
        except StoreError as exc:
            log.warning("usage gate: its figures were not kept (%s)", exc)

    def _read(self) -> None:
        if self.readings is not None:
            self.counts.fold(self.readings())

class UsageGateCollector:
    """What the usage gate holds and dropped, for /metrics: a router reporting tokens no engine
    counted shows here by name."""

    def __init__(self, gate: Callable[[], UsageGate], clock: Callable[[], float] = time.time) -> None:
        self._gate = gate
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        gate = self._gate()
        held = GaugeMetricFamily("llmgw_controller_usage_held_tokens",
                                 "Tokens of routers' batches that wait, unacknowledged, for the model's engines to "
                                 f"count them (recorded once they do; after {HOLD:g} s what does not fit is dropped).",
                                 labels=("model",))
        for model, tokens in sorted(gate.held_tokens(self._clock()).items()):
            held.add_metric((model,), tokens)
        yield held
        dropped = CounterMetricFamily("llmgw_controller_usage_unconfirmed_tokens",
                                      "Tokens a router reported that the engines never counted: dropped, not "
                                      "charged to any budget.", labels=("router",))
        for router, tokens in sorted(gate.dropped.items()):
            dropped.add_metric((router,), tokens)
        yield dropped


class _Counted:
    """The gated ledger as the controller's own router writes to it: every row taken, and counted."""

    def __init__(self, gated: GatedLedger) -> None:
        self._gated = gated

    def record_usage(self, batch: UsageBatch) -> bool:
        recorded = self._gated.inner.record_usage(batch)
        if recorded:
            self._gated._read()  # noqa: SLF001 - the engines' counters kept current with what is counted
            self._gated.gate.counted(batch.rows)
            self._gated.save()
        return recorded

    def usage_seq(self, instance: str) -> int:
        return self._gated.inner.usage_seq(instance)


class UsageFlusher:
    """Moves ``outbox`` (the in-process router's) into ``ledger`` every ``interval`` and at close;
    ``after`` is called after each attempt (the controller hands its router the ledger's figures)."""

    def __init__(self, outbox: UsageOutboxLike, ledger: UsageLedger, *, interval: float = 2.0,
                 compact: Callable[[], object] | None = None, clock: Callable[[], float] = time.monotonic,
                 after: Callable[[], None] | None = None) -> None:
        self.outbox = outbox
        self.ledger = ledger
        self.interval = interval
        self.compact = compact
        self.clock = clock
        self.after = after
        self._task: asyncio.Task[None] | None = None
        self._compacted = clock()
        self._failing = False
        # Usage not recorded is budgets that do not hold after a restart: a critical loop.
        self.health = Tracker("usage-ledger")

    def flush(self) -> None:
        """Record what the router counted; a failure keeps the batch for the next try."""
        batch = self.outbox.take()
        if batch is None:
            return
        try:
            self.ledger.record_usage(batch)
        except StoreError as exc:  # a full disk, a locked database: counted again next time
            if not self._failing:
                log.warning("usage ledger: could not record %d rows (%s); will keep trying", len(batch.rows), exc)
            self._failing = True
            self.health.failed(time.time(), f"recording {len(batch.rows)} usage rows: {describe(exc)}")
            return
        self._failing = False
        self.health.ok(time.time())
        self.outbox.acked(batch.seq)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-flush")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.flush()
            if self.after is not None:
                self.after()
            if self.compact is not None and self.clock() - self._compacted >= COMPACT_EVERY:
                self._compacted = self.clock()
                try:
                    self.compact()
                except StoreError as exc:
                    log.warning("usage ledger: compaction failed (%s)", exc)

    async def close(self) -> None:
        """Stop, after one last flush (call it after the router drained: its last answers count)."""
        await cancel_and_wait(self._task)
        self._task = None
        self.flush()
