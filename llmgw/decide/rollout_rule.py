"""The one rollout rule (DESIGN §5): every transition of a model's rollout, in one function. Pure.

:func:`transition` takes what the controller keeps of a model (:class:`ModelRecord`), the catalog
in force, the replicas and what happened — a tick, a canary placed, no room for one, an
operator's promote or abort — and returns the new record and the events to write. Start, step,
promote, roll back, abort, revert mid-promotion, no room and only replica are all decided here;
the controller (llmgw.reconciler.rollouts) only measures, keeps records and writes events, and
`llmgw diff` (llmgw.plan.rollouts) asks this same function what a change would start.

Windows are measured by the caller: :func:`measured` says which replicas a record's current
window covers, the caller passes back what it measured of them since ``rollout.step_since`` (or
``None`` when this process has no measurement from then: a restarted controller, a step just
begun), and an outcome with ``window_begins`` asks it to start measuring anew.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llmgw.catalog import Catalog, Model
from llmgw.catalog.spec import model_from_json, model_to_json
from llmgw.contract import ReplicaStats
from llmgw.decide.acceptance import FINDING
from llmgw.decide.replica import Replica, ReplicaState, runs
from llmgw.decide.rollout import Phase, Rollout, Windows, advance, model_version, promoted, verify, with_spec

UNKNOWN = "unknown"  # a rollout's stable version when the controller never knew it
# Why no canary can run beside the stable replicas (decide.tick reports which; the rule acts on it).
ONLY_REPLICA = "no room for a canary beside the only replica"
NO_UNAVAILABLE = "no room for a canary beside the stable replicas and max_unavailable 0"
FITS_NOWHERE = "the new version does not fit even in a stable replica's place"
ALREADY_SHORT = "no room for a canary, and the model is already short of max_unavailable replicas"

Event = tuple[str, str]  # (kind, message)


@dataclass(frozen=True)
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


# --- what happened --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tick:
    """Each tick, before the fleet is decided: start, judge a step, finish a promotion."""

    window: Windows | None = None  # of :func:`measured`'s replicas since the rollout's step_since


@dataclass(frozen=True)
class CanaryPlaced:
    replica: str


@dataclass(frozen=True)
class Borrowed:
    """A stable replica is stopping to make room for the canary."""


@dataclass(frozen=True)
class NoRoom:
    """No canary can run beside the stable replicas; ``before``: what they measured over their lives."""

    why: str
    before: ReplicaStats = field(default_factory=ReplicaStats)


@dataclass(frozen=True)
class Promote:
    actor: str


@dataclass(frozen=True)
class Abort:
    actor: str


Happening = Tick | CanaryPlaced | Borrowed | NoRoom | Promote | Abort


@dataclass(frozen=True)
class Outcome:
    record: ModelRecord | None  # None: the model left the catalog, and its history with it
    events: tuple[Event, ...] = ()
    window_begins: bool = False  # measure :func:`measured`'s replicas anew from the rollout's step_since
    refused: str = ""  # an operator's request that cannot be done, in words (the record is unchanged)


@dataclass(frozen=True)
class Groups:
    """The replicas a window covers: the new version's, the old version's (ids)."""

    new: tuple[str, ...]
    old: tuple[str, ...]


# --- the predicates every part uses ------------------------------------------------------------------
def outdated(spec: Model, replicas: Sequence[Replica]) -> bool:
    """Some live stable replica runs another version than ``spec`` (a profile no replica uses
    changes nothing running: such a change applies without a rollout)."""
    return any(x.state.live and not x.canary and not runs(x, spec) for x in replicas)


def canary_of(model: Model, replicas: Sequence[Replica]) -> Replica | None:
    """The canary of THIS version: one of a superseded commit may still be stopping (review: a
    quick fix was rolled back for the failures of the canary it replaced)."""
    return next((x for x in replicas if x.model == model.name and x.canary and x.state.live and runs(x, model)), None)


def judged(record: ModelRecord | None) -> bool:
    """The model's replicas are being measured: a canary phase, or a change judged after the fact."""
    r = record.rollout if record else None
    return r is not None and (r.phase == Phase.CANARY or r.before is not None)


def measured(record: ModelRecord | None, model: Model, replicas: Sequence[Replica]) -> Groups | None:
    """What the record's current window covers (None: no window runs)."""
    r = record.rollout if record else None
    if r is None:
        return None
    ready = [x for x in replicas if x.model == model.name and not x.canary and x.state == ReplicaState.READY]
    if r.phase == Phase.CANARY:
        canary = canary_of(model, replicas)
        if canary is None or canary.state != ReplicaState.READY:
            return None
        return Groups((canary.id,), tuple(x.id for x in ready))
    if r.phase == Phase.PROMOTING and r.verifying:
        return Groups(tuple(x.id for x in ready), ())
    return None


def running_spec(record: ModelRecord, model: Model) -> Model:
    """``model`` as the tick should run it: the catalog's names, scaling and routing, the record's
    serving engines (the stable replicas keep the old version while a canary is judged)."""
    same = record.serving is model or model_version(record.serving) == model_version(model)
    return model if same else with_spec(model, record.serving)


def settled(canary: Replica, model: Model, replicas: Sequence[Replica]) -> Replica:
    """A promoted canary as an ordinary replica of the version now serving: the replacement of one
    old replica (it beside them was a surge), unless it took a stable replica's place. Without
    this the model had one replica too many, and scaling stopped one of the three at random
    (seen: the canary that had just passed), then replaced both old ones."""
    replaced = {x.replaces for x in replicas if x.replaces and x.state.live}
    stable = [x for x in replicas if x.model == canary.model and x.state.live and not x.canary]
    old = [x for x in stable if x.id not in replaced and x.state != ReplicaState.STOPPING and not runs(x, model)]
    surplus = len(stable) >= model.scaling.min
    return replace(canary, canary=False, replaces=old[0].id if old and surplus else None)


def rev(revision: str | None) -> str:
    return revision[:12] if revision else "the catalog in force"


# --- the rule ------------------------------------------------------------------------------------------
def transition(record: ModelRecord | None, catalog: Catalog, name: str, replicas: Sequence[Replica],
               happening: Happening, now: float) -> Outcome:
    """The model's record after ``happening``, and the events it writes."""
    model = catalog.model(name)
    operator = isinstance(happening, Promote | Abort)
    if model is None or (record is None and not isinstance(happening, Tick)):
        # The model left the catalog: its replicas go, and its history.
        return Outcome(record if operator else None,
                       refused=f"no model {name!r} in the catalog in force" if operator else "")
    mine = [x for x in replicas if x.model == name]
    if isinstance(happening, Tick):
        return _tick(record, catalog, model, mine, happening, now)
    assert record is not None
    if isinstance(happening, Promote):
        return _promote(record, model, happening.actor, now)
    if isinstance(happening, Abort):
        return _abort(record, happening.actor, now)
    r = record.rollout
    if r is None or r.phase != Phase.CANARY:
        return Outcome(record)
    if isinstance(happening, CanaryPlaced):
        return Outcome(replace(record, rollout=replace(r, canary=happening.replica, step_since=now)))
    if isinstance(happening, Borrowed):
        return Outcome(replace(record, rollout=replace(r, borrowed=True)))
    return _no_room(record, model, happening, now)


def _tick(record: ModelRecord | None, catalog: Catalog, model: Model, mine: list[Replica], tick: Tick,
          now: float) -> Outcome:
    events: list[Event] = []
    rec = _begin(record, catalog, model, mine, now, events)
    rec, begins = _advance(rec, model, mine, tick.window, now, events)
    ro = rec.rollout
    if ro is not None and ro.phase == Phase.PROMOTING and not outdated(rec.serving, mine) \
            and all(x.state == ReplicaState.READY for x in mine if x.state.live):
        if ro.before is not None:
            rec, begins = _verify(rec, model, tick.window, now, events)
        else:
            rec = replace(rec, rollout=replace(ro, phase=Phase.DONE, ended_at=now,
                                               reason="every replica runs the new version"))
            events.append(("rollout-done", f"{model.name}: rollout to {rev(ro.revision)} done in "
                                           f"{now - ro.started_at:.0f} s"))
    return Outcome(rec, tuple(events), window_begins=begins)


def _begin(record: ModelRecord | None, catalog: Catalog, model: Model, mine: list[Replica], now: float,
           events: list[Event]) -> ModelRecord:
    """The model's record, with a new rollout when git asks for a version that neither serves nor
    is being rolled out (nor was rolled back)."""
    stable = [x for x in mine if x.state.live and not x.canary]
    policy = model.rollout
    canary = policy.strategy == "canary" and not catalog.skip_analysis
    if record is None:
        # First sight: the version its replicas run is the catalog's unless they disagree, and then
        # it is not known (a controller upgraded from before rollouts were kept, or its record was
        # unreadable). Its policy still applies: a canary of the catalog's version is judged while
        # the running replicas are kept as they are (pinned), never a version perhaps just rolled
        # back pushed to every replica (review).
        if not outdated(model, stable):
            return ModelRecord(serving=model)
        unknown = Rollout(model.name, model_version(model), UNKNOWN, policy.strategy,
                          Phase.CANARY if canary else Phase.PROMOTING, started_at=now, revision=catalog.revision,
                          step_since=now, reason="the version its replicas run is not known")
        events.append(("rollout-started", f"{model.name}: {unknown.reason}: "
                                          + ("a canary of the catalog's is judged" if canary else "replaced")))
        return ModelRecord(serving=model, rollout=unknown)
    target, serving = model_version(model), model_version(record.serving)
    r = record.rollout
    if r is not None and r.phase == Phase.PROMOTING and r.target != target and record.previous is not None \
            and target == model_version(record.previous):
        # A revert mid-promotion: back to the version before, at once, as an abort goes (the version
        # being reverted must not go on replacing replicas while the revert is judged).
        back = Rollout(model.name, target, r.target, "replace", Phase.PROMOTING, started_at=now,
                       revision=catalog.revision, step_since=now,
                       reason=f"revert of {rev(r.revision)} mid-promotion: back to the version before")
        events.append(("rollout-aborted", f"{model.name}: {back.reason}"))
        return ModelRecord(serving=model, previous=record.serving, rollout=back)
    if r is not None and r.phase.active and r.target != target:
        went_back = target == (r.stable if r.phase == Phase.CANARY else serving)
        why = ("the catalog went back to the running version" if went_back
               else f"superseded by revision {rev(catalog.revision)}")
        r = r.ended(Phase.ABORTED, now, why)
        events.append(("rollout-aborted", f"{model.name}: rollout to {rev(r.revision)} {why}"))
        record = replace(record, rollout=r)
    if target == serving:
        # Same spec or an equal one: keep the catalog's (its non-engine fields may have changed); git
        # back on what runs: "rolled back" no longer describes it.
        return ModelRecord(model, record.previous, None if r is not None and r.phase.kept_old else r)
    if r is not None and r.target == target and (r.phase.active or r.phase.kept_old):
        return replace(record, serving=model) if r.phase == Phase.PROMOTING else record
    if not stable or not outdated(model, stable):
        # Nothing runs, or nothing running would change: the new version applies at once.
        ended = r.ended(Phase.DONE, now, "nothing running had to change") if r is not None and r.phase.active else r
        return ModelRecord(model, record.serving, ended)
    started = Rollout(model.name, target, serving, policy.strategy, Phase.CANARY if canary else Phase.PROMOTING,
                      started_at=now, revision=catalog.revision, step_since=now)
    how = (f"canary, steps {', '.join(f'{s:g} %' for s in policy.steps)}, {policy.interval:g} s each"
           if canary else
           f"replace, {policy.max_surge} beside at a time (else {policy.max_unavailable} stopped first)")
    if policy.strategy == "canary" and not canary:
        how += "; analysis skipped by the commit's trailer Llmgw-Skip-Analysis"
    events.append(("rollout-started", f"{model.name}: rollout to {rev(catalog.revision)} ({how})"))
    return ModelRecord(record.serving if canary else model, record.serving, started)


def _advance(rec: ModelRecord, model: Model, mine: list[Replica], window: Windows | None, now: float,
             events: list[Event]) -> tuple[ModelRecord, bool]:
    """The canary phase: judge the step whose interval is over (decide.rollout.advance)."""
    r = rec.rollout
    if r is None or r.phase != Phase.CANARY:
        return rec, False
    canary = canary_of(model, mine)
    if canary is None and r.canary is not None:
        r = replace(r, canary=None)  # lost with its node, or stopped: another is placed
    ready = canary is not None and canary.state == ReplicaState.READY
    if ready and window is None:
        # No window measured in this process from the step's start (a new step, a canary just
        # ready, a controller restarted mid-step): the window begins now rather than being judged
        # on what is left of it.
        return replace(rec, rollout=replace(r, step_since=now)), True
    failed = None
    # Twice, for a start (a node's hiccup is tried again); at once for acceptance, whose prompts are
    # deterministic: the canary said the wrong words, and would again.
    if canary is not None and canary.state == ReplicaState.FAILED and (
            canary.failures >= 2 or (canary.error or "").startswith(FINDING)):
        failed = canary.error or "did not start"
    step = advance(r, model.rollout, windows=window or Windows(), canary_ready=ready, canary_failed=failed, now=now)
    events.extend(step.events)
    out = step.rollout
    return replace(rec, serving=model if out.phase == Phase.PROMOTING else rec.serving, rollout=out), step.new_step


def _verify(rec: ModelRecord, model: Model, window: Windows | None, now: float,
            events: list[Event]) -> tuple[ModelRecord, bool]:
    """A change no canary could judge, serving alone now: its window against the old version's
    figures (decide.rollout.verify); failed, back to the version before."""
    ro = rec.rollout
    assert ro is not None
    if not ro.verifying:
        events.append(("rollout-step", f"{model.name}: the new version serves alone; judged against the old "
                                       f"version's figures for {model.rollout.interval:g} s"))
        ro = replace(ro, verifying=True, step_since=now,
                     reason="judged against the old version's figures while it serves")
        return replace(rec, rollout=ro), True
    if window is None:  # a restarted controller: the window begins again
        return replace(rec, rollout=replace(ro, step_since=now)), True
    step = verify(ro, model.rollout, window=window, now=now)
    events.extend(step.events)
    serving = rec.serving
    if step.rollout.phase == Phase.ROLLED_BACK and rec.previous is not None:
        serving = rec.previous  # back to the version before, by ordinary replacement
    return replace(rec, serving=serving, rollout=step.rollout), False


def _no_room(rec: ModelRecord, model: Model, no_room: NoRoom, now: float) -> Outcome:
    r = rec.rollout
    assert r is not None
    if no_room.why == FITS_NOWHERE:
        ended = r.ended(Phase.ROLLED_BACK, now, f"the canary cannot be placed: {no_room.why}")
        return Outcome(replace(rec, rollout=ended), (("rollout-rolled-back", f"{model.name}: {ended.reason}"),))
    if no_room.why != ONLY_REPLICA:
        return Outcome(replace(rec, rollout=replace(r, reason=no_room.why + ": waiting")))
    # One replica and no spare GPU: a canary would have nothing to be compared with, and waiting
    # would never end (the README's tour on a full fleet). Replaced (after its acceptance prompts),
    # then judged against the figures the old version had just before, and taken back by itself if
    # worse.
    before = no_room.before
    ro = replace(promoted(r, now), before=before.to_json(),
                 reason=no_room.why + ": replaced, then judged against the old version's figures")
    return Outcome(ModelRecord(model, rec.serving, ro),
                   (("rollout-promoted", f"{model.name}: {no_room.why}: replaced without a canary; judged once it "
                                         f"serves against the old version's figures ({before.served} requests)"),))


def _promote(rec: ModelRecord, model: Model, actor: str, now: float) -> Outcome:
    """Skip the rest of the analysis: the new version is promoted now (also after a rollback)."""
    r = rec.rollout
    if r is None or not (r.phase == Phase.CANARY or (r.phase.kept_old and r.target == model_version(model))):
        return Outcome(rec, refused=f"{model.name} has no canary or rolled-back rollout to promote")
    ro = replace(promoted(r, now), reason=f"promoted by {actor}", ended_at=None)
    return Outcome(replace(rec, serving=model, rollout=ro),
                   (("rollout-promoted", f"{model.name}: promoted by {actor}, analysis skipped"),))


def _abort(rec: ModelRecord, actor: str, now: float) -> Outcome:
    """Stop the rollout: the canary goes, or (promoting) the replicas go back to the old version."""
    r = rec.rollout
    name = rec.serving.name
    if r is None or not r.phase.active:
        return Outcome(rec, refused=f"{name} has no rollout in progress to abort")
    serving = rec.serving
    if r.phase == Phase.PROMOTING:
        if rec.previous is None:
            # Nothing to go back to (the version before was never known): "aborted" would be a lie.
            return Outcome(rec, refused=f"{name}: the version before this rollout is not known; push the one "
                                        "you want instead")
        serving = rec.previous
    return Outcome(replace(rec, serving=serving, rollout=r.ended(Phase.ABORTED, now, f"aborted by {actor}")),
                   (("rollout-aborted", f"{name}: rollout to {rev(r.revision)} aborted by {actor}"),))


def canary_blocked(policy_max_unavailable: int, *, stable: int, fits_instead: bool, missing: int,
                   first_ready: bool) -> str | None:
    """Why no canary can take a stable replica's place, or None when one may (decide.tick asks
    this where there is no room beside them; `llmgw diff` asks it too)."""
    if stable < 1 or not fits_instead:
        return FITS_NOWHERE
    if policy_max_unavailable < 1:
        return NO_UNAVAILABLE
    if stable < 2:
        return ONLY_REPLICA
    # Replicas already missing count against max_unavailable (review: a model of 3 with one slot
    # empty lost a second one to its canary).
    if missing + first_ready > policy_max_unavailable:
        return ALREADY_SHORT
    return None
