"""The dry run: what a catalog change would do to the running fleet.

Pure, and built on the very `decide()` the controller runs each tick, on the same
inventory and replicas, so the plan is what the controller will do — not an estimate of
it. A replacement the controller carries out over several ticks (start the new one, stop
the old once it serves) is shown as one `replace`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llmgw.catalog import Catalog, NodeSpec
from llmgw.decide.replica import Replica, ReplicaState
from llmgw.decide.rollout import Rollout
from llmgw.decide.tick import decide
from llmgw.inventory import Inventory, follow_nodes
from llmgw.placement import Placement, Rejection
from llmgw.plan.guard import PruneVerdict, judge_prune
from llmgw.plan.rollouts import RolloutPlan, plan_rollouts

GB = 1024**3


@dataclass(frozen=True)
class FleetSnapshot:
    """The fleet as `llmgw inventory export` writes it: nodes and the replicas on them."""

    inventory: Inventory
    replicas: tuple[Replica, ...] = ()
    taken_at: float | None = None
    # The controller's rollouts (each model's last): a change to a model mid-rollout says so.
    rollouts: tuple[Rollout, ...] = ()
    # The node transports the controller drives (`llmgw up`: local only); None: every one. A node
    # of another transport is no candidate of its ticks, so none of the plan's either (seen: five
    # example nodes `up` never manages listed as "has not reported an inventory").
    transports: tuple[str, ...] | None = None
    # The names of the API keys its routers check (never their digests); None: not known, nothing
    # said of the tenants that name keys.
    key_names: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"taken_at": self.taken_at, "inventory": self.inventory.to_json(),
                "replicas": [r.to_json() for r in self.replicas], "rollouts": [r.to_json() for r in self.rollouts],
                "transports": list(self.transports) if self.transports is not None else None,
                "key_names": list(self.key_names) if self.key_names is not None else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetSnapshot:
        transports, keys = data.get("transports"), data.get("key_names")
        return cls(Inventory.from_json(data["inventory"]),
                   tuple(Replica.from_json(r) for r in data.get("replicas", ())), data.get("taken_at"),
                   tuple(Rollout.from_json(r) for r in data.get("rollouts") or ()),
                   tuple(str(t) for t in transports) if isinstance(transports, list) else None,
                   tuple(str(k) for k in keys) if isinstance(keys, list) else None)

    def managed(self, catalog: Catalog) -> tuple[NodeSpec, ...]:
        return tuple(n for n in catalog.nodes if self.transports is None or n.transport in self.transports)


@dataclass(frozen=True)
class Step:
    action: str  # start | stop | replace
    model: str
    profile: str
    where: tuple[tuple[str, tuple[int, ...]], ...]  # (node, gpus) per shard
    reason: str
    replica: str | None = None  # the replica stopped or replaced
    placement: Placement | None = None  # its shards by rank, with what each node must hold

    def where_text(self) -> str:
        return ", ".join(f"{n} gpus {','.join(map(str, g)) or '-'}" for n, g in self.where)


@dataclass(frozen=True)
class NodeUse:
    node: str
    gpus_total: int
    gpus_before: int
    gpus_after: int
    disk_total_gb: float | None
    disk_before_gb: float | None
    disk_after_gb: float | None


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...] = ()
    unplaceable: dict[str, tuple[Rejection, ...]] = field(default_factory=dict)
    unplaced_counts: dict[str, int] = field(default_factory=dict)
    fetches: tuple[tuple[str, str, float, str], ...] = ()  # (node, model, GB, the source it is read from)
    new_orphans: tuple[tuple[str, str, float], ...] = ()  # (node, cache name, GB)
    node_use: tuple[NodeUse, ...] = ()
    without_ready: tuple[tuple[str, str], ...] = ()  # (model, why)
    prune: PruneVerdict | None = None
    still_unplaced: dict[str, int] = field(default_factory=dict)  # unplaceable before the change too
    rollouts: tuple[RolloutPlan, ...] = ()  # models whose running version changes, and how

    def count(self, action: str) -> int:
        return sum(1 for s in self.steps if s.action == action)

    @property
    def empty(self) -> bool:
        return not self.steps and not self.unplaced_counts


def _live(replicas: Sequence[Replica]) -> list[Replica]:
    return [r for r in replicas if r.state.live]


def make_plan(base: Catalog | None, head: Catalog, fleet: FleetSnapshot, *, now: float) -> Plan:
    """Steps, unplaceable models, fetches, orphans and per-node use for ``base`` → ``head``."""
    replicas = list(fleet.replicas)
    # The fleet as each catalog's nodes.yaml has it: a node the head removes is gone, and its
    # replicas with it (a plan against the live node list once showed `nodes: []` stopping nothing).
    inv = Inventory(follow_nodes(fleet.inventory.nodes, fleet.managed(head)), fleet.inventory.taken_at)
    # Nothing looks idle in a plan: idleness is the tick's business, not the change's.
    busy = {r.id: now for r in replicas}
    d = decide(head, inv, replicas, last_used=busy, demand={}, now=now, with_reasons=True)
    creates, unplaced, rejections = list(d.create), dict(d.unplaced), list(d.rejections)
    if d.unavailable_first:
        # On a full fleet old replicas stop first and the new ones take their place at the next tick:
        # the plan says both (seen: "cannot place sim-chat … 2 in use" beside "GPUs free 0/2 → 1/2").
        first = {rid for rid, _ in d.stop}
        after = [replace(r, state=ReplicaState.STOPPED) if r.id in first else r for r in replicas]
        d2 = decide(head, inv, after, last_used=busy, demand={}, now=now, with_reasons=True)
        later = [n for n in d2.create if n.placement.model in d.unavailable_first]
        model_of = {r.id: r.model for r in replicas}
        stopped = {m: ", ".join(sorted(rid for rid in first if model_of.get(rid) == m)) for m in d.unavailable_first}
        creates += [replace(n, reason=f"{n.reason} (once {stopped[n.placement.model]} has stopped)") for n in later]
        for m in d.unavailable_first:
            unplaced.pop(m, None)
            if d2.unplaced.get(m):
                unplaced[m] = d2.unplaced[m]
        rejections = [x for x in rejections if x.model not in d.unavailable_first] + [
            x for x in d2.rejections if x.model in d.unavailable_first]
    # What could not be placed before the change is not the change's doing: shown apart.
    unplaced_before = decide(base, Inventory(follow_nodes(fleet.inventory.nodes, fleet.managed(base))), replicas,
                             last_used=busy, demand={}, now=now).unplaced if base else {}
    still = {m: n for m, n in unplaced.items() if unplaced_before.get(m, 0) >= n}
    new_unplaced = {m: n for m, n in unplaced.items() if m not in still}
    by_id = {r.id: r for r in replicas}
    replaced = {n.replaces for n in creates if n.replaces}
    steps: list[Step] = []
    for new in creates:
        where = tuple((s.node, s.gpus) for s in new.placement.shards)
        if new.replaces:
            steps.append(Step("replace", new.placement.model, new.placement.profile, where, new.reason, new.replaces,
                              new.placement))
        else:
            steps.append(Step("start", new.placement.model, new.placement.profile, where, new.reason,
                              placement=new.placement))
    for rid, why in (*d.lost, *d.stop):
        r = by_id[rid]
        if rid in replaced:
            continue
        steps.append(Step("stop", r.model, r.profile, tuple((s.node, s.gpus) for s in r.placement.shards), why, rid,
                          r.placement))

    # Weights: fetched where a new shard lands without them; orphaned where no model wants them any more.
    fetches = []
    for new in creates:
        model = head.model(new.placement.model)
        if model is None or model.cache_name is None:
            continue
        for s in new.placement.shards:
            node = inv.node(s.node)
            if s.holds_weights and node and node.report and model.cache_name not in node.report.held:
                fetches.append((s.node, model.name, model.size_gb, model.source))
    wanted_after = head.wanted_cache_names()
    wanted_before = base.wanted_cache_names() if base else frozenset()
    orphans = []
    for node in sorted(inv.nodes.values(), key=lambda n: n.id):
        for w in node.report.weights if node.report else ():
            if w.name and w.name in wanted_before and w.name not in wanted_after:
                orphans.append((node.id, w.name, round(w.bytes / GB, 2)))

    # GPU and disk use per node, before and after.
    stopping = {rid for rid, _ in (*d.stop, *d.lost)} | replaced
    use = []
    # Nodes the head removes are shown too: their GPUs going to nothing is the change's doing.
    for node in sorted({**inv.nodes, **fleet.inventory.nodes}.values(), key=lambda n: n.id):
        before = sum(len(s.gpus) for r in _live(replicas) for s in r.placement.shards if s.node == node.id)
        gone = sum(len(s.gpus) for rid in stopping if rid in by_id for s in by_id[rid].placement.shards
                   if s.node == node.id)
        added = sum(len(s.gpus) for n in creates for s in n.placement.shards if s.node == node.id)
        fs = node.report.cache_fs if node.report else None
        local = fs if fs is not None and not fs.shared else None
        total = local.total_bytes / GB if local else None
        used = (local.total_bytes - local.free_bytes) / GB if local else None
        fetched = sum(gb for n, _, gb, _ in fetches if n == node.id)
        use.append(NodeUse(
            node.id, len(node.report.gpus) if node.report else 0, before, before - gone + added,
            round(total, 1) if total is not None else None, round(used, 1) if used is not None else None,
            round(used + fetched, 1) if used is not None else None))

    without = []
    for model in head.models:
        ready_left = [r for r in replicas if r.model == model.name and r.state == ReplicaState.READY
                      and r.id not in {rid for rid, _ in (*d.stop, *d.lost)}]
        if ready_left:
            continue
        if model.name in new_unplaced:
            without.append((model.name, "cannot be placed"))
        elif any(n.placement.model == model.name for n in creates):
            without.append((model.name, "until its new replica is ready"))
        elif model.scaling.min == 0:
            continue  # scaled to zero by design; woken by the first request
    prune = judge_prune(base, head, fleet.inventory, fleet.replicas, now=now) if base is not None else None
    return Plan(
        steps=tuple(steps),
        unplaceable={m: tuple(x for x in rejections if x.model == m) for m in new_unplaced},
        unplaced_counts=new_unplaced,
        still_unplaced=still,
        fetches=tuple(fetches),
        new_orphans=tuple(orphans),
        node_use=tuple(u for u in use if u.gpus_before != u.gpus_after or u.disk_before_gb != u.disk_after_gb),
        without_ready=tuple(without),
        prune=prune,
        rollouts=plan_rollouts(base, head, inv, replicas, now=now, starts=[n.placement for n in creates],
                               live=fleet.rollouts),
    )
