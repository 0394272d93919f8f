"""The controller's side of rollouts (llmgw.decide.rollout_rule decides): records, measurements, operators.

Per model it keeps the spec the stable replicas serve (so a rolled-back model can still start
replicas of its old version), the spec before the current rollout (so an abort can go back), and
the rollout itself — all in the store, so a controller restarted mid-rollout resumes it (the
current step's window starts again: the measurements before the restart are not kept).

Measurements come from the routers (:meth:`UsageSource.replica_stats`: per router process,
per replica, cumulative); :class:`StatsMeter` turns them into totals that only grow, whatever
routers restart, and a step's window is the totals now minus the totals when the step began:
all routers' together, and each router's alone (the rule judges both, so one router's figures
cannot outweigh the others'; issue 41).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmgw.catalog import Catalog, Model
from llmgw.contract import ReplicaStats
from llmgw.decide.replica import Replica
from llmgw.decide.rollout import Phase, Rollout, Windows, by_router, model_version
from llmgw.decide.rollout_rule import (
    ONLY_REPLICA,
    UNKNOWN,
    Abort,
    Borrowed,
    CanaryPlaced,
    Groups,
    Happening,
    ModelRecord,
    NoRoom,
    Outcome,
    Promote,
    Tick,
    judged,
    measured,
    running_spec,
    transition,
)
from llmgw.decide.tick import CanaryWant, Decisions
from llmgw.errors import LlmgwError

log = logging.getLogger(__name__)

MAX_SOURCES = 1_000  # router processes remembered (a restarted router is a new one)
SHOWN_ROUTERS = 5  # routers listed in a rollout's status, most canary requests first


def router_of(source: str) -> str:
    """The router a reading's source (a router process) belongs to: a credential's processes are
    filed as ``NAME/instance`` (llmgw.control.feed), and are one router, the one the credential
    names (a router sending a new process id with each report is still one router, judged and
    named as one); any other source (the controller's own router, a router on the admin token)
    is its own."""
    return source.split("/", 1)[0]


class RolloutError(LlmgwError):
    """An operator's request about a rollout that cannot be done (no such model, nothing to do)."""


class StatsMeter:
    """Totals per replica that only grow, from cumulative readings of routers that may restart:
    all routers' (``totals``) and each router process's (``by_source``, for as long as its last
    reading is remembered)."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, ReplicaStats]] = {}  # oldest reading first
        self.totals: dict[str, ReplicaStats] = {}
        self.by_source: dict[str, dict[str, ReplicaStats]] = {}  # router process → replica → total
        self.forgotten = 0  # router processes whose last reading was dropped (past MAX_SOURCES)

    def fold(self, readings: Mapping[str, Mapping[str, ReplicaStats]], replicas: Iterable[str]) -> None:
        """Add what each router measured of ``replicas`` since its last reading."""
        wanted = set(replicas)
        for source, stats in readings.items():
            # Least recently read first out: a router reporting each tick stays, while one that
            # sends a new process id with every report (each would count as a router started
            # again, its whole life counted anew) pushes out only its own earlier ids.
            last = self._last.pop(source, None) or {}
            self._last[source] = last
            mine = self.by_source.setdefault(source, {})
            for rid, now in stats.items():
                if rid not in wanted:
                    continue
                before = last.get(rid)
                # A reading that does not cover the last one is a router that started again.
                delta = now - before if before is not None and now.covers(before) else now
                self.totals[rid] = self.totals.get(rid, ReplicaStats()) + delta
                mine[rid] = mine.get(rid, ReplicaStats()) + delta
                last[rid] = now + ReplicaStats()  # a copy: a router's live object goes on changing
        if len(self._last) > MAX_SOURCES:
            gone = list(self._last)[: len(self._last) - MAX_SOURCES]
            for source in gone:
                del self._last[source]
                self.by_source.pop(source, None)
            self.forgotten += len(gone)
            log.warning("router readings: %d process(es) forgotten past %d remembered (%d so far); a router "
                        "sending a new process id with each report?", len(gone), MAX_SOURCES, self.forgotten)
        for rid in [r for r in self.totals if r not in wanted]:
            del self.totals[rid]
            for last in self._last.values():
                last.pop(rid, None)
        for source in list(self.by_source):
            mine = self.by_source[source]
            for rid in [r for r in mine if r not in wanted]:
                del mine[rid]
            if not mine:
                del self.by_source[source]

    def total(self, rid: str) -> ReplicaStats:
        return self.totals.get(rid) or ReplicaStats()

    def totals_of(self, rids: Iterable[str]) -> tuple[dict[str, ReplicaStats], dict[str, dict[str, ReplicaStats]]]:
        """The totals of ``rids`` now, all routers' and each router's: a window's start."""
        ids = set(rids)
        pooled = {rid: self.total(rid) for rid in ids}
        # The totals are replaced, never changed in place: keeping them is keeping a reading.
        return pooled, {source: {rid: t for rid, t in mine.items() if rid in ids}
                        for source, mine in self.by_source.items() if not ids.isdisjoint(mine)}


@dataclass(frozen=True)
class Baseline:
    """The meter's totals when a rollout's step began (its window is the totals since)."""

    since: float
    totals: dict[str, ReplicaStats]
    by_source: dict[str, dict[str, ReplicaStats]]


@dataclass(frozen=True)
class Plan:
    """What one tick runs on: the catalog with each model on its serving version, the canaries."""

    catalog: Catalog
    canaries: Mapping[str, CanaryWant]
    notes: Mapping[str, str]
    pinned: frozenset[str] = frozenset()  # models whose running version is not known: kept as they are


class RolloutDriver:
    """Starts, advances and ends rollouts; one per reconciler."""

    def __init__(self, store: Any, *, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        self.records: dict[str, ModelRecord] = {}
        self.meter = StatsMeter()
        self._baselines: dict[str, Baseline] = {}  # model → the totals when its step began
        # model → its window as last measured, and how many processes each router measured it from (status)
        self._windows: dict[str, tuple[Windows, dict[str, int]]] = {}
        # This tick's: the routers' readings, and each model's live replicas that are not canaries.
        self._read: Callable[[], Mapping[str, Mapping[str, ReplicaStats]]] = dict
        self._readings: Mapping[str, Mapping[str, ReplicaStats]] | None = None
        self._live_ids: dict[str, set[str]] = {}
        self._saved: dict[str, Any] | None = None
        self.desired: Catalog | None = None  # the catalog as git has it, for canaries and operators

    def load(self) -> None:
        for name, raw in self.store.rollout_records().items():
            try:
                self.records[name] = ModelRecord.from_json(raw)
            except (KeyError, TypeError, ValueError) as exc:
                # A record this llmgw cannot read must not stop the controller: the model is taken
                # as serving what the catalog says, as on a first start.
                log.warning("rollout record of %s unreadable (%s); starting over for it", name, exc)
        self._saved = {n: r.to_json() for n, r in self.records.items()}

    def save(self) -> None:
        records = {n: r.to_json() for n, r in self.records.items()}
        if records != self._saved:
            self.store.save_rollout_records(records)
            self._saved = records

    def rollout(self, name: str) -> Rollout | None:
        rec = self.records.get(name)
        return rec.rollout if rec else None

    # --- each tick, before decide() ----------------------------------------------------------
    def plan(self, catalog: Catalog, replicas: Mapping[str, Replica],
             readings: Callable[[], Mapping[str, Mapping[str, ReplicaStats]]], now: float) -> Plan:
        """Start, advance and end rollouts for ``catalog`` (decide.rollout_rule); the catalog the
        tick should run. ``readings``: the routers' measurements, read only while some model is
        judged (they are a copy of every replica's histograms: not a cost every tick should pay)."""
        self.desired = catalog
        reps = list(replicas.values())
        self._live_ids = {}
        for r in reps:
            if r.state.live and not r.canary:
                self._live_ids.setdefault(r.model, set()).add(r.id)
        watched = [r.id for r in reps if judged(self.records.get(r.model))]
        self._read, self._readings = readings, None
        self.meter.fold(self._read_once() if watched else {}, watched)
        for name in [n for n in self.records if catalog.model(n) is None]:
            del self.records[name]
            self._baselines.pop(name, None)
        self._windows = {}
        models: list[Model] = []
        canaries: dict[str, CanaryWant] = {}
        notes: dict[str, str] = {}
        pinned: set[str] = set()
        for model in catalog.models:
            rec = self.records.get(model.name)
            groups = measured(rec, model, reps)
            measured_now = self._window(model.name, rec, groups)
            window = measured_now[0] if measured_now is not None else None
            if measured_now is not None:
                self._windows[model.name] = measured_now
            rec = self._carry_out(model.name, transition(rec, catalog, model.name, reps, Tick(window), now), reps)
            assert rec is not None
            ro = rec.rollout
            if ro is not None and ro.phase == Phase.CANARY:
                canaries[model.name] = CanaryWant(spec=model, borrowed=ro.borrowed)
            elif ro is not None and ro.phase != Phase.DONE:
                notes[model.name] = f"rollout {ro.phase.value}" + (f": {ro.reason}" if ro.reason else "")
            if ro is not None and ro.stable == UNKNOWN and (ro.phase == Phase.CANARY or ro.phase.kept_old):
                pinned.add(model.name)
            models.append(running_spec(rec, model))
        running = catalog if all(a is b for a, b in zip(models, catalog.models, strict=True)) \
            else replace(catalog, models=tuple(models))
        return Plan(running, canaries, notes, frozenset(pinned))

    def _carry_out(self, name: str, out: Outcome, replicas: list[Replica]) -> ModelRecord | None:
        """Keep the rule's record, write its events, and measure the window it begins."""
        if out.refused:
            raise RolloutError(out.refused)
        for kind, message in out.events:
            self.store.add_event(kind, name, message)
        if out.record is None:
            self.records.pop(name, None)
            self._baselines.pop(name, None)
            return None
        self.records[name] = out.record
        model = self.desired.model(name) if self.desired else None
        groups = measured(out.record, model, replicas) if model is not None else None
        if groups is None:
            self._baselines.pop(name, None)
        elif out.window_begins:
            assert out.record.rollout is not None
            self._baselines[name] = Baseline(out.record.rollout.step_since,
                                             *self.meter.totals_of((*groups.new, *groups.old)))
            self._windows.pop(name, None)
        return out.record

    def _window(self, name: str, rec: ModelRecord | None,
                groups: Groups | None) -> tuple[Windows, dict[str, int]] | None:
        """What ``groups`` measured since the rollout's step began, if this process measured it
        from then (totals now minus totals at the step's start): all routers' and each router's
        (:func:`router_of`), and how many processes each router measured it from."""
        base = self._baselines.get(name)
        if groups is None or rec is None or rec.rollout is None or base is None or base.since != rec.rollout.step_since:
            return None
        zero = ReplicaStats()

        def total(ids: tuple[str, ...], now: Mapping[str, ReplicaStats],
                  then: Mapping[str, ReplicaStats]) -> ReplicaStats:
            s = ReplicaStats()
            for rid in ids:
                if rid in now:
                    s = s + (now[rid] - then.get(rid, zero))
            return s

        routers: dict[str, Windows] = {}
        processes: dict[str, int] = {}
        for source, mine in self.meter.by_source.items():
            then = base.by_source.get(source, {})
            canary, stable = total(groups.new, mine, then), total(groups.old, mine, then)
            if canary.requests or stable.requests:
                router = router_of(source)
                before = routers.get(router) or Windows()
                routers[router] = Windows(before.canary + canary, before.stable + stable)
                processes[router] = processes.get(router, 0) + 1
        return Windows(total(groups.new, self.meter.totals, base.totals),
                       total(groups.old, self.meter.totals, base.totals), routers), processes

    # --- after decide() ------------------------------------------------------------------------
    def decided(self, d: Decisions, created: Mapping[str, str], now: float, replicas: Iterable[Replica] = ()) -> None:
        """Note what the tick did for rollouts: canaries created (model → replica id), stable
        replicas stopped to make room, canaries that cannot run at all."""
        if self.desired is None:
            return
        reps = list(replicas)
        happened: list[tuple[str, Happening]] = [(n, CanaryPlaced(rid)) for n, rid in created.items()]
        happened += [(n, Borrowed()) for n in d.borrowed]
        happened += [(n, NoRoom(why, self._figures_of(n) if why == ONLY_REPLICA else ReplicaStats()))
                     for n, why in d.no_canary_room.items()]
        for name, what in happened:
            if name in self.records:
                self._carry_out(name, transition(self.records[name], self.desired, name, reps, what, now), reps)

    def _read_once(self) -> Mapping[str, Mapping[str, ReplicaStats]]:
        """This tick's readings, read at most once (a change with no room reads them the tick it starts)."""
        if self._readings is None:
            self._readings = self._read()
        return self._readings

    def _figures_of(self, model: str) -> ReplicaStats:
        """What the routers measured of ``model``'s replicas over their lives (their cumulative readings)."""
        total = ReplicaStats()
        live = self._live_ids.get(model, ())
        for stats in self._read_once().values():
            for rid, s in stats.items():
                if rid in live:
                    total = total + s
        return total

    def canary_percent(self, name: str) -> float:
        rec = self.records.get(name)
        if rec is None or rec.rollout is None or self.desired is None:
            return 0.0
        model = self.desired.model(name)
        return rec.rollout.percent(model.rollout) if model else 0.0

    # --- operators ------------------------------------------------------------------------------
    def promote(self, name: str, actor: str) -> Rollout:
        """Skip the rest of the analysis: the new version is promoted now (also after a rollback)."""
        return self._operate(name, Promote(actor))

    def abort(self, name: str, actor: str) -> Rollout:
        """Stop the rollout: the canary goes, or (promoting) the replicas go back to the old version."""
        return self._operate(name, Abort(actor))

    def _operate(self, name: str, what: Happening) -> Rollout:
        if self.desired is None:
            raise RolloutError(f"no model {name!r} in the catalog in force")
        rec = self._carry_out(name, transition(self.records.get(name), self.desired, name, (), what, self.clock()), [])
        assert rec is not None and rec.rollout is not None
        return rec.rollout

    def status(self) -> list[dict[str, Any]]:
        """Every model's last rollout, for `llmgw rollout status`, the API and the dashboard."""
        out = []
        for name, rec in sorted(self.records.items()):
            r = rec.rollout
            if r is None:
                continue
            model = self.desired.model(name) if self.desired else None
            d = r.to_json()
            d["percent"] = r.percent(model.rollout) if model else 0.0
            d["steps"] = list(model.rollout.steps) if model else []
            d["interval"] = model.rollout.interval if model else None
            d["serving_version"] = model_version(rec.serving)
            d["window"] = self._window_status(name, r)
            out.append(d)
        return out

    def _window_status(self, name: str, r: Rollout) -> dict[str, Any] | None:
        """The current step's window so far, and who measured it: the routers with the most canary
        requests (an operator sees when one router is most of the evidence)."""
        measured_now = self._windows.get(name)
        base = self._baselines.get(name)
        if measured_now is None or base is None or base.since != r.step_since or not (
                r.phase == Phase.CANARY or r.verifying):
            return None
        w, processes = measured_now
        rows = by_router(w)
        return {"since": r.step_since, "canary_requests": w.canary.requests, "stable_requests": w.stable.requests,
                "routers": [{"router": router, "canary_requests": c, "stable_requests": s,
                             "processes": processes.get(router, 1)} for router, c, s in rows[:SHOWN_ROUTERS]],
                "routers_not_shown": max(len(rows) - SHOWN_ROUTERS, 0)}
