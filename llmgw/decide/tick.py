"""What the reconciler should do this tick: pure, from desired, actual, usage and time.

Returns decisions; `Reconciler` applies them. Keeping this pure is what lets `llmgw diff`
show the same plan the controller will carry out, and what lets the scaling rules be
tested without a single engine.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from enum import Enum

from llmgw.catalog import Catalog, Model, ModelName, NodeId, Profile
from llmgw.contract import Demand
from llmgw.decide.replica import Replica, ReplicaState, fingerprint
from llmgw.decide.rollout_rule import canary_blocked
from llmgw.inventory import Inventory, NodeState, becomes_ours
from llmgw.inventory.model import engine_labels
from llmgw.placement import Placement, PlacementResult, Rejection, Shard, place


@dataclass(frozen=True)
class Settings:
    unreachable_grace: float = 30.0


@dataclass(frozen=True)
class NewReplica:
    placement: Placement
    replaces: str | None = None
    reason: str = "scale up"
    canary: bool = False  # the new version of a model in a canary rollout




@dataclass(frozen=True)
class CanaryWant:
    """A model in the canary phase of a rollout (llmgw.decide.rollout), as one tick needs it."""

    spec: Model  # the new version the canary runs (the catalog's model; the others keep the old)
    borrowed: bool = False  # a stable replica was stopped to make room for the canary


@dataclass(frozen=True)
class Decisions:
    stop: tuple[tuple[str, str], ...] = ()  # (replica id, reason)
    create: tuple[NewReplica, ...] = ()
    lost: tuple[tuple[str, str], ...] = ()  # replicas given up for dead with their node
    unplaced: Mapping[str, int] = field(default_factory=dict)
    rejections: tuple[Rejection, ...] = ()
    # Rollouts under full capacity: models whose old replicas are being stopped before their
    # replacement can be placed (max_unavailable at a time), with the reason in words.
    unavailable_first: Mapping[str, str] = field(default_factory=dict)
    borrowed: tuple[str, ...] = ()  # models whose canary took a stable replica's place this tick
    no_canary_room: Mapping[str, str] = field(default_factory=dict)  # model → why no canary can run
    # Stops that are a rollout's, not a removal: an old replica stopped first for its replacement,
    # a stable one making room for a canary (the prune guard does not count them).
    for_rollout: frozenset[str] = frozenset()
    # Replicas on a draining node whose replacement has no room elsewhere (replica id → why): they
    # go on serving, so they are not "unplaced", and the drain waits for them (said, not silent).
    drain_waits: Mapping[str, str] = field(default_factory=dict)


def _node_lost(inventory: Inventory, node_id: NodeId, now: float, grace: float) -> bool:
    node = inventory.node(node_id)
    if node is None:
        return True  # the node left nodes.yaml
    if node.state == NodeState.FENCED and not node.lapsing:
        return True  # another controller took it over: its engines are that one's to run
    return node.unreachable_since is not None and now - node.unreachable_since >= grace


def unclaimed_engines(inventory: Inventory, replicas: Sequence[Replica]) -> list[Placement]:
    """What live engines no replica of ours claims hold (another controller's, or our stale ones
    until they are stopped): their GPUs are taken, whoever started them."""
    claimed = {(s.node, s.agent_id) for r in replicas for s in r.shards}
    return [Placement(ModelName(f"(engine {e.replica_id})"), "", (Shard(node.id, 0, e.gpus),))
            for node in inventory.nodes.values() if node.report is not None
            for e in node.report.engines if e.alive and e.gpus and (node.id, e.replica_id) not in claimed]


def coming_replicas(inventory: Inventory, replicas: Sequence[Replica]) -> dict[str, int]:
    """Per model, the replicas whose engines run on nodes that become this controller's once a
    silent holder's lease lapses (:func:`llmgw.inventory.becomes_ours`) and that no record claims:
    adopted then, so none is placed meanwhile to be stopped as surplus after. Canaries excepted
    (a rollout judges those)."""
    claimed = {(s.node, s.agent_id) for r in replicas for s in r.shards}
    coming: dict[str, set[tuple[str | None, str]]] = defaultdict(set)
    for node in inventory.nodes.values():
        if node.report is None or not becomes_ours(node):
            continue
        for e in node.report.engines:
            labels = engine_labels(e) if e.alive and (node.id, e.replica_id) not in claimed else None
            if labels is not None and not labels.canary:
                coming[labels.model].add((e.holder, labels.replica))
    return {model: len(ids) for model, ids in coming.items()}


def holding(inventory: Inventory, replicas: Sequence[Replica], *, lost: Collection[str] = ()) -> list[Placement]:
    """What holds GPUs, RAM and disk now: every replica not stopped (a stopping one until it has
    stopped; ``lost`` ones excepted) and every live engine no replica claims. Placement, `explain`
    and `llmgw nodes` all count with this, so none calls a GPU free that another would not use."""
    return ([r.placement for r in replicas if r.id not in lost and r.state != ReplicaState.STOPPED]
            + unclaimed_engines(inventory, replicas))


def _draining(inventory: Inventory, node_id: NodeId) -> bool:
    node = inventory.node(node_id)
    return node is not None and node.state == NodeState.DRAINING


def _idle_for(r: Replica, last_used: Mapping[str, float], now: float) -> float:
    used = last_used.get(r.id)
    since = max(x for x in (used, r.ready_since, r.created_at) if x is not None)
    return now - since


class Replace(str, Enum):
    """Why a running replica must be replaced (a new one started first, the old stopped once the
    new one serves). An enum, not text: the phases below steer by it."""

    PROFILE_CHANGED = "its profile changed"
    NODE_DRAINING = "its node is draining"


@dataclass
class _Tick:
    """What one decide() pass works on and what its phases have decided so far."""

    catalog: Catalog
    inventory: Inventory
    replicas: Sequence[Replica]
    last_used: Mapping[str, float]
    demand: Mapping[str, Demand]
    now: float
    settings: Settings
    canaries: Mapping[str, CanaryWant] = field(default_factory=dict)
    canary_notes: Mapping[str, str] = field(default_factory=dict)
    pinned: Collection[str] = ()
    by_id: dict[str, Replica] = field(default_factory=dict)
    stop: dict[str, str] = field(default_factory=dict)  # replica id → why (text for events and the plan)
    lost: list[tuple[str, str]] = field(default_factory=list)
    replace: dict[str, Replace] = field(default_factory=dict)  # old id → why it must be replaced
    wanted: dict[str, int] = field(default_factory=dict)  # model → new replicas to place
    targets: dict[str, int] = field(default_factory=dict)  # model → replicas it should have (slots)
    unavailable_first: dict[str, str] = field(default_factory=dict)
    for_rollout: set[str] = field(default_factory=set)
    borrowed: list[str] = field(default_factory=list)
    no_canary_room: dict[str, str] = field(default_factory=dict)
    drain_waits: dict[str, str] = field(default_factory=dict)
    # A fingerprint hashes the whole model and profile: once per profile per tick, not per replica
    # (it was most of a steady tick's cost on a fleet of 600 replicas).
    fingerprints: dict[tuple[str, str, bool], str] = field(default_factory=dict)

    def fingerprint(self, model: Model, profile: Profile, *, canary: bool = False) -> str:
        # Keyed by name: the catalog's version, or (``canary``) the new version a canary runs.
        key = (model.name, profile.name, canary)
        if key not in self.fingerprints:
            self.fingerprints[key] = fingerprint(model, profile)
        return self.fingerprints[key]

    @property
    def lost_ids(self) -> set[str]:
        return {i for i, _ in self.lost}


def decide(
    catalog: Catalog,
    inventory: Inventory,
    replicas: Sequence[Replica],
    *,
    last_used: Mapping[str, float],
    demand: Mapping[str, Demand],
    now: float,
    settings: Settings = Settings(),
    with_reasons: bool = False,
    canaries: Mapping[str, CanaryWant] | None = None,
    canary_notes: Mapping[str, str] | None = None,
    pinned: Collection[str] = (),
) -> Decisions:
    """Stops, new replicas and losses that bring the fleet toward ``catalog``.

    ``with_reasons`` lists every rejected candidate of models that cannot be placed (for
    `llmgw diff`); a tick leaves it off and explains one model on demand. ``canaries``: models in
    the canary phase of a rollout (``catalog`` has their stable version); ``canary_notes``: why
    the canary replicas of other models must go (their rollout ended), per model. ``pinned``:
    models whose running replicas are kept whatever their fingerprint (the version they run is
    not known to the controller, and a canary of the catalog's is judged first).
    """
    t = _Tick(catalog, inventory, replicas, last_used, demand, now, settings, canaries or {}, canary_notes or {},
              pinned, by_id={r.id: r for r in replicas})
    _judge_running(t)
    replacements = _replacements(t)
    _scale(t)
    result, create = _place_new(t, replacements, with_reasons=with_reasons)
    create += _place_canaries(t, [c.placement for c in create])
    # Not "unplaced": a replica serving on while its drain waits, and the slot of an old replica
    # stopped to make room (its replacement is placed there next tick).
    unplaced = {m: n - sum(1 for w in (*t.drain_waits, *t.for_rollout) if w in t.by_id and t.by_id[w].model == m)
                for m, n in result.unplaced.items()}
    return Decisions(tuple(t.stop.items()), tuple(create), tuple(t.lost), {m: n for m, n in unplaced.items() if n > 0},
                     result.rejections, dict(t.unavailable_first), tuple(t.borrowed), dict(t.no_canary_room),
                     frozenset(t.for_rollout), dict(t.drain_waits))


def _judge_running(t: _Tick) -> None:
    """1. Replicas that cannot stay as they are: their model left, their node is gone, their
    profile changed, their node drains."""
    for r in t.replicas:
        if not r.state.live:
            continue
        model = t.catalog.model(r.model)
        if model is None:
            t.stop[r.id] = "model left the catalog"
            continue
        gone = [n for n in r.nodes if _node_lost(t.inventory, n, t.now, t.settings.unreachable_grace)]
        if gone:
            t.lost.append((r.id, _lost_because(t.inventory, gone)))
            continue
        if r.canary:
            # A canary is judged by its rollout, never replaced: it stays while its rollout is in
            # the canary phase for the version it runs, and goes (without a replacement) otherwise.
            want = t.canaries.get(r.model)
            spec_profile = want.spec.profile(r.profile) if want is not None else None
            if want is None or spec_profile is None \
                    or t.fingerprint(want.spec, spec_profile, canary=True) != r.fingerprint:
                t.stop[r.id] = t.canary_notes.get(r.model) or "canary of a rollout that ended"
            elif any(_draining(t.inventory, n) for n in r.nodes):
                # A drain must empty the node: the rollout places another canary elsewhere.
                t.stop[r.id] = "its node is draining: the canary is placed elsewhere"
            continue
        profile = model.profile(r.profile)
        if profile is None or t.fingerprint(model, profile) != r.fingerprint:
            if r.model not in t.pinned:
                t.replace[r.id] = Replace.PROFILE_CHANGED
        elif any(_draining(t.inventory, n) for n in r.nodes):
            t.replace[r.id] = Replace.NODE_DRAINING


def _lost_because(inventory: Inventory, gone: list[NodeId]) -> str:
    left = [n for n in gone if inventory.node(n) is None]
    fenced = [n for n in gone if (x := inventory.node(n)) is not None and x.state == NodeState.FENCED]
    if left:
        return f"node {', '.join(left)} left nodes.yaml"
    if fenced:
        return f"node {', '.join(fenced)} is driven by another controller"
    return f"node {', '.join(gone)} unreachable past the grace period"


def _replacements(t: _Tick) -> dict[str, list[str]]:
    """2. Start the new one first; stop the old once the new one is ready. Returns, per model, the
    old replicas that still need a replacement placed (a replacement whose old replica is already
    gone serves as an ordinary replica)."""
    replacing = {r.replaces: r for r in t.replicas if r.replaces and r.state.live}
    wanted: dict[str, list[str]] = defaultdict(list)
    surging: dict[str, int] = defaultdict(int)  # per model: replacements started, not serving yet
    for old_id, why in t.replace.items():
        new = replacing.get(old_id)
        if new is None:
            wanted[t.by_id[old_id].model].append(old_id)
        elif new.state == ReplicaState.READY:
            t.stop[old_id] = f"replaced by {new.id} ({why.value})"
        else:
            surging[new.model] += 1
    # At most ``max_surge`` replacements beside old replicas at a time (a change reaches a model
    # a few replicas at a time, not all at once); the others wait their turn.
    for name, olds in wanted.items():
        model = t.catalog.model(name)
        room = max((model.rollout.max_surge if model else 1) - surging[name], 0)
        del olds[room:]
    return {name: olds for name, olds in wanted.items() if olds}


def _scale(t: _Tick) -> None:
    """3. Each model within [min, max], by demand and idleness."""
    lost_ids = t.lost_ids
    by_model: dict[str, list[Replica]] = defaultdict(list)  # once, not a scan of the fleet per model
    for r in t.replicas:
        if r.state.live and r.id not in t.stop and r.id not in lost_ids and not r.canary:
            by_model[r.model].append(r)
    coming = coming_replicas(t.inventory, t.replicas)
    for model in t.catalog.models:
        mine = by_model.get(model.name, [])
        # A replica and its replacement hold one slot between them, until the old one stops
        # (here or earlier).
        slots = [r for r in mine if not (r.replaces and r.replaces in t.by_id and r.replaces not in t.stop
                                         and t.by_id[r.replaces].state.live)]
        count = len(slots)
        ready = [r for r in slots if r.state == ReplicaState.READY]
        d = t.demand.get(model.name, Demand())
        s = model.scaling
        want = t.canaries.get(model.name)
        # A canary that took a stable replica's place (no room to surge) holds that slot.
        floor = s.min - 1 if want is not None and want.borrowed else s.min
        target = min(max(count, floor), s.max)
        t.targets[model.name] = target
        if d.held and count == 0:
            target = max(target, min(1, s.max))
        if ready and d.inflight > s.target_inflight * len(ready) and count == len(ready):
            target = min(count + 1, s.max)
        if count > s.max:
            # Not-ready ones first, then the longest idle.
            extra = sorted(slots, key=lambda r: (r.state == ReplicaState.READY, -_idle_for(r, t.last_used, t.now)))
            for r in extra[: count - s.max]:
                t.stop[r.id] = f"above max ({s.max})"
            continue
        # Idleness is judged per replica from the router's last use, but never while the
        # model's load would not fit on one replica fewer: a replica just added for load is
        # not "idle" before the router has sent it anything.
        fits_fewer = d.inflight <= s.target_inflight * max(len(ready) - 1, 0)
        # While a canary is judged its model keeps a stable replica: idled to none, every request
        # would go to the unjudged canary, and the analysis would wait for stable traffic forever.
        keep = max(s.min, 1) if want is not None else s.min
        if s.idle_after is not None and not d.held and count > keep and fits_fewer:
            idle = sorted((r for r in ready if _idle_for(r, t.last_used, t.now) >= s.idle_after
                           and r.id not in t.replace),
                          key=lambda r: -_idle_for(r, t.last_used, t.now))
            for r in idle[: count - keep]:
                t.stop[r.id] = (f"idle for {int(_idle_for(r, t.last_used, t.now))}s "
                                f"(idle_after {int(s.idle_after)}s)")
                target = min(target, count - 1)
        if target > count + coming.get(model.name, 0):
            t.wanted[model.name] = target - count - coming.get(model.name, 0)


def _place_new(t: _Tick, replacements: dict[str, list[str]], *,
               with_reasons: bool) -> tuple[PlacementResult, list[NewReplica]]:
    """4. Place what is wanted; stopping replicas (and engines no replica claims) still hold their
    GPUs until they stop."""
    wanted = dict(t.wanted)
    for name, olds in replacements.items():
        wanted[name] = wanted.get(name, 0) + len(olds)
    # Only the draining nodes: a replica across nodes may keep its other shards' nodes (avoiding
    # them all left a two-node replica nowhere to go on a three-node fabric).
    avoid: dict[str, list[NodeId]] = {
        t.by_id[o].model: [n for n in t.by_id[o].nodes if _draining(t.inventory, n)]
        for olds in replacements.values() for o in olds if t.replace[o] == Replace.NODE_DRAINING}
    # Most ticks want nothing new: skip building the fleet's free-capacity index then.
    if any(wanted.values()):
        held = holding(t.inventory, t.replicas, lost=t.lost_ids)
        result = place(t.catalog, t.inventory, held, now=t.now, wanted=wanted, avoid=avoid, reasons=with_reasons)
    else:
        result = PlacementResult()
    create: list[NewReplica] = []
    queue = {name: list(olds) for name, olds in replacements.items()}
    for p in result.placements:
        waiting = queue.get(p.model)
        if waiting:
            old = waiting.pop(0)
            create.append(NewReplica(p, replaces=old, reason=f"replaces {old}: {t.replace[old].value}"))
        else:
            create.append(NewReplica(p, reason=_reason(t.catalog.model(p.model), t.demand)))
    left = {name: olds for name, olds in queue.items() if olds}
    _unavailable_first(t, left)
    for olds in left.values():
        for old in olds:
            if t.replace[old] == Replace.NODE_DRAINING and old not in t.stop:
                r = t.by_id[old]
                draining = ", ".join(sorted({n for n in r.nodes if _draining(t.inventory, n)}))
                t.drain_waits[old] = (f"no room for its replacement ({r.model}/{r.profile}) off {draining}: it "
                                      f"serves on until there is (`llmgw explain {r.model}`)")
    return result, create


def _unavailable_first(t: _Tick, unplaced: Mapping[str, list[str]]) -> None:
    """4b. Models whose replacement found no room (a full fleet, or ``max_surge: 0``): stop up to
    ``max_unavailable`` old replicas first; their slots are filled with the new version once their
    GPUs are free (scaling brings the model back to its count). Without this a change on a fleet
    with no spare GPUs would never roll out."""
    replacing = {r.replaces for r in t.replicas if r.replaces and r.state.live}
    olds: dict[str, list[str]] = defaultdict(list)  # per model: old replicas no replacement is coming for
    for old_id in t.replace:
        if old_id not in t.stop and old_id not in replacing:
            olds[t.by_id[old_id].model].append(old_id)
    for name, candidates in olds.items():
        model = t.catalog.model(name)
        if model is None or not (name in unplaced or model.rollout.max_surge == 0):
            continue
        limit = model.rollout.max_unavailable
        if limit == 0:
            t.unavailable_first[name] = "no room to start a new replica beside the old, and max_unavailable 0: waiting"
            continue
        ready = sum(1 for r in t.replicas if r.model == name and r.state == ReplicaState.READY and not r.canary
                    and r.id not in t.stop and r.id not in t.lost_ids)
        room = limit - max(t.targets.get(name, 0) - ready, 0)
        candidates.sort(key=lambda o: t.by_id[o].state == ReplicaState.READY)  # not serving first
        why = (f"no room to start a new replica beside the old: replaced {limit} at a time "
               f"(max_unavailable {limit})") if model.rollout.max_surge else \
            f"max_surge 0: replaced {limit} at a time (max_unavailable {limit})"
        t.unavailable_first[name] = why
        for old_id in candidates:
            serving = t.by_id[old_id].state == ReplicaState.READY
            if room <= 0 and serving:
                break
            if not _fits_instead(t, t.catalog, name, t.by_id[old_id]):
                # Stopping it would leave the model a replica short for nothing (seen: a profile
                # asking for a GPU class no node has).
                t.unavailable_first[name] = "the new version does not fit even in an old replica's place: waiting"
                break
            t.stop[old_id] = f"{t.replace[old_id].value}; {why}"
            t.for_rollout.add(old_id)
            room -= serving


def _fits_instead(t: _Tick, catalog: Catalog, name: str, old: Replica, placed: Sequence[Placement] = ()) -> bool:
    """Whether one replica of ``catalog``'s model ``name`` could be placed once ``old`` is gone."""
    held = [p for p in holding(t.inventory, t.replicas, lost=t.lost_ids) if p is not old.placement]
    result = place(catalog, t.inventory, held + list(placed), now=t.now, wanted={name: 1}, reasons=False)
    return bool(result.placements)


def _place_canaries(t: _Tick, placed: Sequence[Placement]) -> list[NewReplica]:
    """5. One canary per model in the canary phase, beside the stable replicas; where there is no
    room, a stable replica makes room (``max_unavailable``), never the only one (the canary would
    have nothing to be compared with)."""
    needed = [name for name, want in t.canaries.items()
              if not any(r.canary and r.model == name and r.state.live and r.id not in t.stop
                         and r.id not in t.lost_ids for r in t.replicas)]
    if not needed:
        return []
    models: dict[str, Model] = {m.name: m for m in t.catalog.models}
    for name in needed:
        if name in models:
            models[name] = _replace(models[name], source=t.canaries[name].spec.source,
                                    task=t.canaries[name].spec.task, size_gb=t.canaries[name].spec.size_gb,
                                    profiles=t.canaries[name].spec.profiles)
    catalog = _replace(t.catalog, models=tuple(models.values()))
    held = holding(t.inventory, t.replicas, lost=t.lost_ids) + list(placed)
    wanted = {name: 1 for name in needed if name in models and models[name].rollout.max_surge > 0}
    result = place(catalog, t.inventory, held, now=t.now, wanted=wanted, reasons=False) if wanted \
        else PlacementResult()
    create = [NewReplica(p, reason="canary of the new version", canary=True) for p in result.placements]
    done = {p.model for p in result.placements}
    for name in needed:
        if name in done or name not in models:
            continue
        want = t.canaries[name]
        policy = models[name].rollout
        if want.borrowed:
            continue  # a stable replica is stopping for it: placed once its GPUs are free
        stable = sorted((r for r in t.replicas if r.model == name and r.state.live and not r.canary
                         and r.id not in t.stop and r.id not in t.lost_ids),
                        key=lambda r: (r.state == ReplicaState.READY, -_idle_for(r, t.last_used, t.now)))
        ready = sum(1 for r in stable if r.state == ReplicaState.READY)
        missing = max(t.targets.get(name, 0) - ready, 0)
        blocked = canary_blocked(policy.max_unavailable, stable=len(stable),
                                 fits_instead=bool(stable) and _fits_instead(t, catalog, name, stable[0], placed),
                                 missing=missing, first_ready=bool(stable) and stable[0].state == ReplicaState.READY)
        if blocked is not None:
            t.no_canary_room[name] = blocked
            continue
        t.stop[stable[0].id] = ("making room for the canary of the new version "
                                f"(no room to start it beside; max_unavailable {policy.max_unavailable})")
        t.for_rollout.add(stable[0].id)
        t.borrowed.append(name)
    return create


def _reason(model: Model | None, demand: Mapping[str, Demand]) -> str:
    if model is None:
        return "scale up"
    d = demand.get(ModelName(model.name), Demand())
    if d.held:
        return f"woken by {d.held} held request(s)"
    if d.inflight:
        return f"{d.inflight} requests in flight"
    return f"scaling.min {model.scaling.min}"
