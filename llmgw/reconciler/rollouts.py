"""The controller's side of rollouts (llmgw.decide.rollout decides): records, measurements, operators.

Per model it keeps the spec the stable replicas serve (so a rolled-back model can still start
replicas of its old version), the spec before the current rollout (so an abort can go back), and
the rollout itself — all in the store, so a controller restarted mid-rollout resumes it (the
current step's window starts again: the measurements before the restart are not kept).

Measurements come from the routers (:meth:`UsageSource.replica_stats`: per router process,
per replica, cumulative); :class:`StatsMeter` turns them into totals that only grow, whatever
routers restart, and a step's window is the totals now minus the totals when the step began.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmgw.catalog import Catalog, Model
from llmgw.catalog.spec import model_from_json, model_to_json
from llmgw.contract import ReplicaStats
from llmgw.decide.acceptance import FINDING
from llmgw.decide.replica import Replica, ReplicaState, runs
from llmgw.decide.rollout import Phase, Rollout, Windows, advance, model_version, promoted, verify, with_spec
from llmgw.decide.tick import FITS_NOWHERE, ONLY_REPLICA, CanaryWant, Decisions
from llmgw.errors import LlmgwError

log = logging.getLogger(__name__)

MAX_SOURCES = 1_000  # router processes remembered (a restarted router is a new one)
UNKNOWN = "unknown"  # a rollout's stable version when the controller never knew it


class RolloutError(LlmgwError):
    """An operator's request about a rollout that cannot be done (no such model, nothing to do)."""


class StatsMeter:
    """Totals per replica that only grow, from cumulative readings of routers that may restart."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, ReplicaStats]] = {}
        self.totals: dict[str, ReplicaStats] = {}

    def fold(self, readings: Mapping[str, Mapping[str, ReplicaStats]], replicas: Iterable[str]) -> None:
        """Add what each router measured of ``replicas`` since its last reading."""
        wanted = set(replicas)
        for source, stats in readings.items():
            last = self._last.setdefault(source, {})
            for rid, now in stats.items():
                if rid not in wanted:
                    continue
                before = last.get(rid)
                # A reading that does not cover the last one is a router that started again.
                delta = now - before if before is not None and now.covers(before) else now
                self.totals[rid] = self.totals.get(rid, ReplicaStats()) + delta
                last[rid] = now + ReplicaStats()  # a copy: a router's live object goes on changing
        if len(self._last) > MAX_SOURCES:
            for source in list(self._last)[: len(self._last) - MAX_SOURCES]:
                del self._last[source]
        for rid in [r for r in self.totals if r not in wanted]:
            del self.totals[rid]
            for last in self._last.values():
                last.pop(rid, None)

    def total(self, rid: str) -> ReplicaStats:
        return self.totals.get(rid) or ReplicaStats()


@dataclass
class ModelRecord:
    """What the controller keeps of one model's versions."""

    serving: Model  # what its stable replicas run
    previous: Model | None = None  # what they ran before the current rollout (an abort goes back to it)
    rollout: Rollout | None = None

    def to_json(self) -> dict[str, Any]:
        return {"serving": model_to_json(self.serving),
                "previous": model_to_json(self.previous) if self.previous else None,
                "rollout": self.rollout.to_json() if self.rollout else None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ModelRecord:
        return cls(model_from_json(d["serving"]), model_from_json(d["previous"]) if d.get("previous") else None,
                   Rollout.from_json(d["rollout"]) if d.get("rollout") else None)


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
        self._baselines: dict[str, tuple[float, dict[str, ReplicaStats]]] = {}  # model → (step_since, totals)
        # This tick's: the routers' readings, and each model's live replicas that are not canaries.
        self._readings: Callable[[], Mapping[str, Mapping[str, ReplicaStats]]] | None = None
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
        """Start, advance and end rollouts for ``catalog``; the catalog the tick should run.
        ``readings``: the routers' measurements, read only while some canary is judged (they are a
        copy of every replica's histograms: not a cost every tick should pay)."""
        self.desired = catalog
        for name in [n for n in self.records if catalog.model(n) is None]:
            del self.records[name]  # the model left the catalog: its replicas go, and its history
        by_model: dict[str, list[Replica]] = {}
        for r in replicas.values():
            by_model.setdefault(r.model, []).append(r)
        self._readings = readings
        self._live_ids = {}
        for r in replicas.values():
            if r.state.live and not r.canary:
                self._live_ids.setdefault(r.model, set()).add(r.id)
        judged = [r.id for r in replicas.values()
                  if (rec := self.records.get(r.model)) and rec.rollout and (
                      rec.rollout.phase == Phase.CANARY or rec.rollout.before is not None)]
        self.meter.fold(readings() if judged else {}, judged)
        models: list[Model] = []
        canaries: dict[str, CanaryWant] = {}
        notes: dict[str, str] = {}
        pinned: set[str] = set()
        for model in catalog.models:
            mine = by_model.get(model.name, [])
            rec = self._begin(catalog, model, mine, now)
            rec.rollout = self._advance(model, rec, mine, now)
            ro = rec.rollout
            if ro is not None and ro.phase == Phase.PROMOTING and not self._outdated(rec.serving, mine) \
                    and all(x.state == ReplicaState.READY for x in mine if x.state.live):
                if ro.before is not None:
                    self._verify(model, rec, mine, now)
                else:
                    rec.rollout = replace(ro, phase=Phase.DONE, ended_at=now,
                                          reason="every replica runs the new version")
                    took = now - ro.started_at
                    self.store.add_event("rollout-done", model.name,
                                         f"{model.name}: rollout to {_rev(ro.revision)} done in {took:.0f} s")
            ro = rec.rollout
            if ro is not None and ro.phase == Phase.CANARY:
                canaries[model.name] = CanaryWant(spec=model, borrowed=ro.borrowed)
            elif ro is not None and ro.phase != Phase.DONE:
                notes[model.name] = f"rollout {ro.phase.value}" + (f": {ro.reason}" if ro.reason else "")
            if ro is not None and ro.stable == UNKNOWN and (ro.phase == Phase.CANARY or ro.phase.kept_old):
                pinned.add(model.name)
            same = rec.serving is model or model_version(rec.serving) == model_version(model)
            models.append(model if same else with_spec(model, rec.serving))
        running = catalog if all(a is b for a, b in zip(models, catalog.models, strict=True)) \
            else replace(catalog, models=tuple(models))
        return Plan(running, canaries, notes, frozenset(pinned))

    def _begin(self, catalog: Catalog, model: Model, mine: list[Replica], now: float) -> ModelRecord:
        """The model's record, with a new rollout when git asks for a version that neither serves
        nor is being rolled out (nor was rolled back)."""
        rec = self.records.get(model.name)
        stable = [r for r in mine if r.state.live and not r.canary]
        if rec is None:
            # First sight: the version its replicas run is the catalog's unless they disagree, and
            # then it is not known (a controller upgraded from before rollouts were kept, or its
            # record was unreadable). Its policy still applies: a canary of the catalog's version
            # is judged while the running replicas are kept as they are (pinned), never a version
            # perhaps just rolled back pushed to every replica (review).
            rec = self.records[model.name] = ModelRecord(serving=model)
            if self._outdated(model, stable):
                canary = model.rollout.strategy == "canary" and not catalog_skips_analysis(catalog)
                rec.rollout = Rollout(model.name, model_version(model), UNKNOWN, model.rollout.strategy,
                                      Phase.CANARY if canary else Phase.PROMOTING, started_at=now,
                                      revision=catalog.revision, step_since=now,
                                      reason="the version its replicas run is not known")
                self.store.add_event("rollout-started", model.name,
                                     f"{model.name}: {rec.rollout.reason}: " + ("a canary of the catalog's is judged"
                                                                                 if canary else "replaced"))
            return rec
        target, serving = model_version(model), model_version(rec.serving)
        r = rec.rollout
        if r is not None and r.phase == Phase.PROMOTING and r.target != target and rec.previous is not None \
                and target == model_version(rec.previous):
            # A revert mid-promotion: back to the version before, at once, as an abort goes (the
            # version being reverted must not go on replacing replicas while the revert is judged).
            rec.serving, rec.previous = model, rec.serving
            rec.rollout = Rollout(model.name, target, r.target, "replace", Phase.PROMOTING, started_at=now,
                                  revision=catalog.revision, step_since=now,
                                  reason=f"revert of {_rev(r.revision)} mid-promotion: back to the version before")
            self.store.add_event("rollout-aborted", model.name, f"{model.name}: {rec.rollout.reason}")
            return rec
        if r is not None and r.phase.active and r.target != target:
            back = target == (r.stable if r.phase == Phase.CANARY else serving)
            why = ("the catalog went back to the running version" if back
                   else f"superseded by revision {_rev(catalog.revision)}")
            rec.rollout = r.ended(Phase.ABORTED, now, why)
            self.store.add_event("rollout-aborted", model.name, f"{model.name}: rollout to {_rev(r.revision)} {why}")
            r = rec.rollout
        if target == serving:
            # Same spec object or an equal one: keep the catalog's (its non-engine fields may have changed).
            rec.serving = model
            if r is not None and r.phase.kept_old:
                rec.rollout = None  # git went back to what runs: "rolled back" no longer describes it
            return rec
        if r is not None and r.target == target and (r.phase.active or r.phase.kept_old):
            if r.phase == Phase.PROMOTING:
                rec.serving = model
            return rec
        if not stable or not self._outdated(model, stable):
            # Nothing runs, or nothing running would change (e.g. a profile added that no replica
            # uses): the new version applies at once, without a rollout.
            rec.previous, rec.serving = rec.serving, model
            if r is not None and r.phase.active:
                rec.rollout = r.ended(Phase.DONE, now, "nothing running had to change")
            return rec
        policy = model.rollout
        canary = policy.strategy == "canary" and not catalog_skips_analysis(catalog)
        rec.previous = rec.serving
        rec.rollout = Rollout(model.name, target, serving, policy.strategy, Phase.CANARY if canary else Phase.PROMOTING,
                              started_at=now, revision=catalog.revision, step_since=now)
        if not canary:
            rec.serving = model
        how = (f"canary, steps {', '.join(f'{s:g} %' for s in policy.steps)}, {policy.interval:g} s each"
               if canary else
               f"replace, {policy.max_surge} beside at a time (else {policy.max_unavailable} stopped first)")
        if policy.strategy == "canary" and not canary:
            how += "; analysis skipped by the commit's trailer Llmgw-Skip-Analysis"
        self.store.add_event("rollout-started", model.name,
                             f"{model.name}: rollout to {_rev(catalog.revision)} ({how})")
        return rec

    def _advance(self, model: Model, rec: ModelRecord, mine: list[Replica], now: float) -> Rollout | None:
        r = rec.rollout
        if r is None or r.phase != Phase.CANARY:
            return r
        # The canary of THIS version: one of a superseded commit may still be stopping (review: a
        # quick fix was rolled back for the failures of the canary it replaced).
        canary = next((x for x in mine if x.canary and x.state.live and runs(x, model)), None)
        if canary is None and r.canary is not None:
            r = replace(r, canary=None)  # lost with its node, or stopped: another is placed
        if ready_now := (canary is not None and canary.state == ReplicaState.READY):
            if model.name not in self._baselines and r.step_since < now:
                # No window measured in this process (a controller restarted mid-step): the step's
                # window begins again now rather than being judged on what is left of it.
                r = replace(r, step_since=now)
        del ready_now
        failed = None
        # Twice, for a start (a node's hiccup is tried again); at once for acceptance, whose
        # prompts are deterministic: the canary said the wrong words, and would again.
        if canary is not None and canary.state == ReplicaState.FAILED and (
                canary.failures >= 2 or (canary.error or "").startswith(FINDING)):
            failed = canary.error or "did not start"
        ready = canary is not None and canary.state == ReplicaState.READY
        windows = self._windows(model.name, r, canary, mine, ready)
        step = advance(r, model.rollout, windows=windows, canary_ready=ready, canary_failed=failed, now=now)
        for kind, message in step.events:
            self.store.add_event(kind, model.name, message)
        out = step.rollout
        if out.phase == Phase.PROMOTING:
            rec.serving = model
        return out

    def _verify(self, model: Model, rec: ModelRecord, mine: list[Replica], now: float) -> None:
        """A change no canary could judge, serving alone now: its window against the old version's
        figures (decide.rollout.verify); failed, back to the version before."""
        ro = rec.rollout
        assert ro is not None
        serving = [x for x in mine if x.state == ReplicaState.READY and not x.canary]
        base = self._baselines.get(model.name)
        if not ro.verifying or base is None or base[0] != ro.step_since:
            # The window begins when the new version serves alone (or again, in a restarted controller).
            if not ro.verifying:
                ro = replace(ro, verifying=True, step_since=now,
                             reason="judged against the old version's figures while it serves")
                self.store.add_event("rollout-step", model.name,
                                     f"{model.name}: the new version serves alone; judged against the old "
                                     f"version's figures for {model.rollout.interval:g} s")
            self._baselines[model.name] = (ro.step_since, {x.id: self.meter.total(x.id) for x in serving})
            rec.rollout = ro
            return
        zero = ReplicaStats()
        window = ReplicaStats()
        for x in serving:
            window = window + (self.meter.total(x.id) - base[1].get(x.id, zero))
        step = verify(ro, model.rollout, window=window, now=now)
        for kind, message in step.events:
            self.store.add_event(kind, model.name, message)
        rec.rollout = step.rollout
        if step.rollout.phase == Phase.ROLLED_BACK:
            self._baselines.pop(model.name, None)
            if rec.previous is not None:  # back to the version before, by ordinary replacement
                rec.serving = rec.previous

    def _windows(self, name: str, r: Rollout, canary: Replica | None, mine: list[Replica], ready: bool) -> Windows:
        """The step's measurements: totals now minus totals when the step began (taken then)."""
        stable = [x for x in mine if not x.canary and x.state == ReplicaState.READY]
        base = self._baselines.get(name)
        if not ready or canary is None:
            self._baselines.pop(name, None)
            return Windows()
        if base is None or base[0] != r.step_since:
            # A new step (or a restarted controller): the window begins now.
            base = (r.step_since, {x.id: self.meter.total(x.id) for x in (canary, *stable)})
            self._baselines[name] = base
        zero = ReplicaStats()
        c = self.meter.total(canary.id) - base[1].get(canary.id, zero)
        s = ReplicaStats()
        for x in stable:
            s = s + (self.meter.total(x.id) - base[1].get(x.id, zero))
        return Windows(c, s)

    @staticmethod
    def _outdated(spec: Model, replicas: Iterable[Replica]) -> bool:
        """Some replica runs another version than ``spec``."""
        return any(x.state.live and not x.canary and not runs(x, spec) for x in replicas)

    # --- after decide() ------------------------------------------------------------------------
    def decided(self, d: Decisions, created: Mapping[str, str], now: float) -> None:
        """Note what the tick did for rollouts: canaries created (model → replica id), stable
        replicas stopped to make room, canaries that cannot run at all."""
        for name, rid in created.items():
            rec = self.records.get(name)
            if rec and rec.rollout and rec.rollout.phase == Phase.CANARY:
                rec.rollout = replace(rec.rollout, canary=rid, step_since=now)
        for name in d.borrowed:
            rec = self.records.get(name)
            if rec and rec.rollout:
                rec.rollout = replace(rec.rollout, borrowed=True)
        for name, why in d.no_canary_room.items():
            rec = self.records.get(name)
            if not (rec and rec.rollout and rec.rollout.phase == Phase.CANARY) or self.desired is None:
                continue
            model = self.desired.model(name)
            if model is None:
                continue
            if why == FITS_NOWHERE:
                rec.rollout = rec.rollout.ended(Phase.ROLLED_BACK, now, f"the canary cannot be placed: {why}")
                self.store.add_event("rollout-rolled-back", name, f"{name}: {rec.rollout.reason}")
                continue
            if why != ONLY_REPLICA:
                rec.rollout = replace(rec.rollout, reason=why + ": waiting")
                continue
            # One replica and no spare GPU: a canary would have nothing to be compared with, and
            # waiting would never end (the full fleet). Replaced (after its acceptance
            # prompts), then judged against the figures the old version had just before (what the
            # routers measured of it in their lives), and taken back by itself if worse.
            before = self._figures_of(name)
            rec.rollout = replace(promoted(rec.rollout, now), before=before.to_json(),
                                  reason=why + ": replaced, then judged against the old version's figures")
            rec.previous, rec.serving = rec.serving, model
            self.store.add_event("rollout-promoted", name, f"{name}: {why}: replaced without a canary; judged "
                                                           f"once it serves against the old version's figures "
                                                           f"({before.served} requests)")

    def _figures_of(self, model: str) -> ReplicaStats:
        """What the routers measured of ``model``'s replicas over their lives (their cumulative readings)."""
        total = ReplicaStats()
        live = self._live_ids.get(model, ())
        for stats in (self._readings() if self._readings is not None else {}).values():
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
        rec, model = self._operated(name)
        r = rec.rollout
        now = self.clock()
        if r is None or not (r.phase == Phase.CANARY or (r.phase.kept_old and r.target == model_version(model))):
            raise RolloutError(f"{name} has no canary or rolled-back rollout to promote")
        rec.rollout = replace(promoted(r, now), reason=f"promoted by {actor}", ended_at=None)
        rec.serving = model
        self.store.add_event("rollout-promoted", name, f"{name}: promoted by {actor}, analysis skipped")
        return rec.rollout

    def abort(self, name: str, actor: str) -> Rollout:
        """Stop the rollout: the canary goes, or (promoting) the replicas go back to the old version."""
        rec, _model = self._operated(name)
        r = rec.rollout
        now = self.clock()
        if r is None or not r.phase.active:
            raise RolloutError(f"{name} has no rollout in progress to abort")
        if r.phase == Phase.PROMOTING:
            if rec.previous is None:
                # Nothing to go back to (the version before was never known): "aborted" would be a lie.
                raise RolloutError(f"{name}: the version before this rollout is not known; push the one you "
                                   "want instead")
            rec.serving = rec.previous
        rec.rollout = r.ended(Phase.ABORTED, now, f"aborted by {actor}")
        self.store.add_event("rollout-aborted", name, f"{name}: rollout to {_rev(r.revision)} aborted by {actor}")
        return rec.rollout

    def _operated(self, name: str) -> tuple[ModelRecord, Model]:
        model = self.desired.model(name) if self.desired else None
        rec = self.records.get(name)
        if model is None or rec is None:
            raise RolloutError(f"no model {name!r} in the catalog in force")
        return rec, model

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
            out.append(d)
        return out


def catalog_skips_analysis(catalog: Catalog) -> bool:
    """The commit carried ``Llmgw-Skip-Analysis: yes`` (an emergency fix goes out without a canary)."""
    return catalog.skip_analysis


def _rev(revision: str | None) -> str:
    return revision[:12] if revision else "the catalog in force"
