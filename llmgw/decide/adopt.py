"""Adoption (DESIGN §5, High availability): what a controller makes of running engines that none of
its replica records claims, on the nodes whose lease it holds.

A controller taking nodes over finds engines it has no record of: a new leader those the old one
started, a controller on an older copy of its data dir (a restored backup) those started since the
copy, one on an empty data dir all of them. Those that are what the catalog asks for now are
adopted: their records are rebuilt from the labels they were started with
(:class:`llmgw.inventory.model.EngineLabels`) and what the agents report (node, GPUs, pid, port),
in state ``starting`` with ``adopted`` set, so each is probed once before it serves and none is
restarted. The others are stopped, each with its reason. Left running beside new ones they held
their GPUs until an operator ran `llmgw node takeover --stop-foreign` (seen: a controller on a fresh
data dir started 2 new engines and left the 2 that served orphaned).

The rule, in order, per replica (every shard an engine labelled with its replica id):
- Only engines on a node this controller holds are judged. A replica with a shard on a node that may
  still become this controller's (in handover, unreachable within the grace, not heard from yet)
  waits; one with a shard on a node another controller drives, or none, is incomplete.
- Stopped: the replica was given up by this controller (stopped, or lost with its node: the engine
  ran on through a cut-off); the engine is this controller's own (its holder id, or unstamped) and
  numbered at or below the generations it has issued (given up in an earlier life); its id is that
  of a replica this controller has; labels missing; its model or profile left the catalog; its
  fingerprint is not the one the catalog (or, for a canary, the rollout in its canary phase) asks
  for; a shard missing, ended or unlike its profile (engine, GPU count, GPUs the node does not
  report or another replica holds, no endpoint to serve on); a canary with no rollout asking for
  one, or beside a canary that runs already; more replicas than ``scaling.max``.
- Otherwise adopted, the oldest generations first.

Pure: the reconciler calls :func:`adopt` each tick before decide(), so adopted replicas count toward
the model's replicas and nothing new is placed beside them, and applies what it returns.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.catalog import Catalog, Model, ModelName, NodeId, Profile
from llmgw.decide.replica import Replica, ReplicaState, ShardStatus, fingerprint
from llmgw.decide.tick import CanaryWant
from llmgw.engines.argv import holds_weights, shard_engine
from llmgw.inventory.model import (
    EngineLabels,
    EngineRecord,
    Inventory,
    Node,
    NodeState,
    becomes_ours,
    engine_labels,
    missing_labels,
)
from llmgw.placement import Placement, Shard

# Nodes it acts on (an operator's cordon or drain does not change whose node it is).
_ACTED_ON = (NodeState.READY, NodeState.CORDONED, NodeState.DRAINING)


@dataclass(frozen=True)
class StaleEngine:
    """An engine to stop, and why (for the stale-engine-stopped event)."""

    node: NodeId
    agent_id: str  # the engine's replica_id on its node's agent
    rank: int  # stopped head first (DESIGN §5)
    pid: int | None
    reason: str


@dataclass(frozen=True)
class Adoption:
    """What :func:`adopt` decided: records to add, engines to stop, and replicas left to a later tick."""

    adopt: tuple[Replica, ...] = ()
    stop: tuple[StaleEngine, ...] = ()
    waiting: tuple[tuple[str, str], ...] = ()  # (replica id, why): a shard is on a node not (yet) ours
    highest: int = 0  # the highest generation among the engines judged: the counter moves past it

    @property
    def empty(self) -> bool:
        return not (self.adopt or self.stop or self.waiting)


@dataclass
class _Group:
    """The unclaimed engines labelled with one replica id, by one controller."""

    replica: str
    holder: str | None
    shards: list[tuple[Node, EngineRecord]] = field(default_factory=list)

    @property
    def generation(self) -> int:
        labels = [x for _, e in self.shards if (x := engine_labels(e)) is not None]
        return max((x.generation for x in labels), default=0)


def adopt(
    catalog: Catalog,
    inventory: Inventory,
    replicas: Sequence[Replica],
    *,
    now: float,
    holder: str | None = None,
    issued: int = 0,
    given_up: Collection[str] = (),
    canaries: Mapping[str, CanaryWant] | None = None,
    unreachable_grace: float = 30.0,
) -> Adoption:
    """Which unclaimed engines on the nodes this controller holds to adopt and which to stop.

    ``catalog``: each model on the version its stable replicas serve (a rollout's old one until it is
    promoted); ``canaries``: models in a rollout's canary phase, with the version their canary runs.
    ``holder``: this controller's lease holder id; ``issued``: the highest generation numbered before
    this life began (its store's counter at start: what this life numbers its records claim, and
    what it adopts moves the counter, never this); ``given_up``: ids of replicas it stopped or gave
    up in this life. A returned record is in state ``starting``, ``adopted``; every unclaimed engine
    running on a node this controller holds is in one record, in ``stop``, or (its replica) in
    ``waiting``.
    """
    canaries = canaries or {}
    claimed = {(s.node, s.agent_id) for r in replicas for s in r.shards}
    groups: dict[tuple[str | None, str], _Group] = {}
    for node in inventory.nodes.values():
        if node.report is None:
            continue
        for e in node.report.engines:
            rid = e.label("llmgw.replica")
            if rid is None or (node.id, e.replica_id) in claimed:
                continue  # not started by llmgw (nothing of ours to judge), or a record's
            groups.setdefault((e.holder, rid), _Group(rid, e.holder)).shards.append((node, e))
    if not groups:
        return Adoption()  # the usual tick: every engine is a record's
    known = {r.id for r in replicas}
    judge = _Judge(catalog, inventory, replicas, canaries, now=now, unreachable_grace=unreachable_grace)
    adopted: list[Replica] = []
    stop: list[StaleEngine] = []
    waiting: list[tuple[str, str]] = []
    highest = 0
    # Oldest first: when scaling.max leaves room for fewer than run, the longest-serving stay.
    for g in sorted(groups.values(), key=lambda g: (g.generation, g.replica, g.holder or "")):
        highest = max(highest, g.generation)  # another controller's too: no new replica takes its id
        if not any(_held(node) and e.alive for node, e in g.shards):
            continue  # nothing of it runs on a node this controller acts on: another's, or ended
        own = g.holder is None or g.holder == holder
        if g.replica in given_up:
            why = f"replica {g.replica} was given up by this controller (stopped, or lost with its node): stale"
        elif own and 0 < g.generation <= issued:
            why = (f"generation {g.generation} was numbered by this controller (counter {issued}) and its "
                   "replica given up (stale)")
        elif g.replica in known:
            why = "its replica id is taken by a replica of this controller that does not claim it"
        else:
            verdict = judge(g)
            if isinstance(verdict, Replica):
                adopted.append(verdict)
                known.add(verdict.id)  # another controller's engines of the same id are not this replica
                continue
            if isinstance(verdict, _Wait):
                waiting.append((g.replica, verdict.why))
                continue
            why = verdict
        stop += [StaleEngine(node.id, e.replica_id, _rank(e), e.pid, why)
                 for node, e in g.shards if _held(node) and e.alive]
    return Adoption(tuple(adopted), tuple(stop), tuple(waiting), highest)


@dataclass(frozen=True)
class _Wait:
    """Neither adopted nor stopped this tick: a shard may be on a node not (yet) this controller's."""

    why: str


def _held(node: Node) -> bool:
    """This controller acts on the node: its lease is ours (or no lease is kept: an unfenced
    dispatcher, the only one driving it)."""
    report = node.report
    return report is not None and node.state in _ACTED_ON and (report.lease is None or report.lease.held)


def _rank(e: EngineRecord) -> int:
    """The shard's rank by its label, else by its agent id (``<replica>.r<rank>``), else 0: what
    orders stops head first even for an engine whose other labels are missing."""
    for text in (e.label("llmgw.rank") or "", e.replica_id.rpartition(".r")[2]):
        if text.isascii() and text.isdigit():
            return int(text)
    return 0


class _Judge:
    """One group's verdict: a rebuilt record, why it is stopped (text), or why it waits."""

    def __init__(self, catalog: Catalog, inventory: Inventory, replicas: Sequence[Replica],
                 canaries: Mapping[str, CanaryWant], *, now: float, unreachable_grace: float) -> None:
        self.catalog = catalog
        self.inventory = inventory
        self.canaries = canaries
        self.now = now
        self.grace = unreachable_grace
        # GPUs held per node (records not stopped), and how many replicas each model has.
        self.taken: dict[NodeId, set[int]] = defaultdict(set)
        self.count: dict[str, int] = defaultdict(int)
        self.canary: set[str] = set()  # models with a live canary
        for r in replicas:
            if r.state == ReplicaState.STOPPED:
                continue
            for s in r.placement.shards:
                self.taken[s.node].update(s.gpus)
            if r.state.live and r.canary:
                self.canary.add(r.model)
            elif r.state.live:
                self.count[r.model] += 1

    def __call__(self, g: _Group) -> Replica | _Wait | str:
        shards = sorted(g.shards, key=lambda ne: _rank(ne[1]))
        missing = sorted({k for _, e in shards for k in missing_labels(e)})
        if missing:
            return f"labels missing ({', '.join(missing)}): started by an llmgw older than adoption, or not by llmgw"
        labels = [x for _, e in shards if (x := engine_labels(e)) is not None]
        head = labels[0]
        if any((x.model, x.profile, x.shards, x.generation, x.fingerprint, x.canary) !=
               (head.model, head.profile, head.shards, head.generation, head.fingerprint, head.canary)
               for x in labels):
            return "its shards' labels disagree (model, profile, shard count, generation, fingerprint or canary)"
        model, profile, why = self._version(head)
        if model is None or profile is None:
            return why
        found = self._shards(g, head, profile)
        if not isinstance(found, list):
            return found
        if head.canary:
            if model.name in self.canary:
                return f"a canary of {model.name} runs already"
        elif self.count[model.name] >= model.scaling.max:
            return f"{model.name} has {self.count[model.name]} replica(s), its scaling.max ({model.scaling.max})"
        replica = self._record(g, head, model, profile, found)
        for s in replica.placement.shards:
            self.taken[s.node].update(s.gpus)
        if head.canary:
            self.canary.add(model.name)
        else:
            self.count[model.name] += 1
        return replica

    def _version(self, x: EngineLabels) -> tuple[Model | None, Profile | None, str]:
        """The spec the engine must run to be adopted: the serving version, or its rollout's canary."""
        serving = self.catalog.model(ModelName(x.model))
        if serving is None:
            return None, None, f"model {x.model} left the catalog"
        if x.canary:
            want = self.canaries.get(x.model)
            if want is None:
                return None, None, f"a canary of {x.model}, whose rollout is not in its canary phase"
            model = want.spec
        else:
            model = serving
        profile = model.profile(x.profile)
        if profile is None:
            return None, None, f"profile {x.profile} of {x.model} left the catalog"
        want_fp = fingerprint(model, profile)
        if want_fp != x.fingerprint:
            which = "the canary's version" if x.canary else "the version it serves"
            return None, None, (f"stale version of {x.model}/{x.profile} (fingerprint {x.fingerprint}; "
                                f"{which} is {want_fp})")
        return model, profile, ""

    def _shards(self, g: _Group, head: EngineLabels,
                profile: Profile) -> list[tuple[Node, EngineRecord]] | _Wait | str:
        """Every shard found, alive, on a node this controller holds, and as its profile runs it; or why not."""
        if head.shards != profile.nodes:
            return f"{head.shards} shard(s), its profile runs {profile.nodes}"
        by_rank: dict[int, list[tuple[Node, EngineRecord]]] = defaultdict(list)
        for node, e in g.shards:
            by_rank[_rank(e)].append((node, e))
        if any(len(v) > 1 for v in by_rank.values()) or any(r >= profile.nodes for r in by_rank):
            return "more shards than its profile runs (ranks repeated or out of range)"
        found = []
        for rank in range(profile.nodes):
            if rank not in by_rank:
                return self._absent(g, rank)
            node, e = by_rank[rank][0]
            why: _Wait | str | None = self._elsewhere(node, rank) if not _held(node) \
                else self._unlike(node, e, rank, profile)
            if why is not None:
                return why
            found.append((node, e))
        if not found[0][1].endpoint:
            return "its head (rank 0) reports no endpoint to serve on"
        nodes = [node.id for node, _ in found]
        if len(set(nodes)) != len(nodes):
            return "two shards on one node"
        return found

    def _absent(self, g: _Group, rank: int) -> _Wait | str:
        """Rank ``rank`` is reported by no node: wait while a node that could hold it may yet be
        heard from as ours (its shard may be there)."""
        pending = sorted(n.id for n in self.inventory.nodes.values() if self._may_become_ours(n))
        if pending and g.shards and any(_held(n) for n, _ in g.shards):
            return _Wait(f"rank {rank} not reported; node(s) {', '.join(pending)} not this controller's yet")
        return f"incomplete: rank {rank} runs on no node this controller holds"

    def _elsewhere(self, node: Node, rank: int) -> _Wait | str:
        if self._may_become_ours(node):
            return _Wait(f"rank {rank} is on node {node.id} ({node.state.value}), not this controller's yet")
        return f"incomplete: rank {rank} is on node {node.id}, which another controller drives"

    def _may_become_ours(self, node: Node) -> bool:
        if node.state == NodeState.UNREACHABLE:
            return node.unreachable_since is None or self.now - node.unreachable_since < self.grace
        # Not heard from yet, or its silent holder's lease lapses (llmgw.inventory.becomes_ours).
        return node.state == NodeState.UNKNOWN or becomes_ours(node)

    def _unlike(self, node: Node, e: EngineRecord, rank: int, profile: Profile) -> _Wait | str | None:
        """Why the shard is not what its profile runs on what its node reports, or None; a wait
        while the node could not read its GPUs (an nvidia-smi that timed out reads as no GPU at all,
        and its engines were stopped as holding GPUs the node does not have)."""
        if not e.alive:
            return f"rank {rank} on {node.id} has ended (exit code {e.exit_code})"
        if e.engine != shard_engine(profile, rank):
            return f"rank {rank} on {node.id} runs {e.engine!r}, its profile {shard_engine(profile, rank)!r}"
        if len(e.gpus) != profile.gpus or len(set(e.gpus)) != len(e.gpus):
            return f"rank {rank} on {node.id} holds GPUs {list(e.gpus)}, its profile takes {profile.gpus}"
        report = node.report
        reported = {gpu.index: gpu for gpu in report.gpus} if report is not None else {}
        unknown = [i for i in e.gpus if i not in reported]
        if unknown and report is not None and report.gpu_error:
            return _Wait(f"rank {rank} on {node.id}: its GPUs could not be read ({report.gpu_error})")
        if unknown:
            return f"rank {rank} on {node.id} holds GPUs {unknown} the node does not report"
        if profile.gpu_class and any(reported[i].gpu_class not in profile.gpu_class for i in e.gpus):
            return f"rank {rank} on {node.id} runs on GPUs of a class its profile does not allow"
        taken = sorted(self.taken[node.id].intersection(e.gpus))
        if taken:
            return f"rank {rank} on {node.id} holds GPUs {taken} that another replica holds"
        return None

    def _record(self, g: _Group, x: EngineLabels, model: Model, profile: Profile,
                found: list[tuple[Node, EngineRecord]]) -> Replica:
        placement = Placement(
            model=model.name, profile=profile.name,
            shards=tuple(Shard(node.id, rank, e.gpus, holds_weights=holds_weights(profile, rank))
                         for rank, (node, e) in enumerate(found)),
            memory_gb=float(profile.memory_gb or 0), size_gb=model.size_gb, weights=model.cache_name,
        )
        shards = tuple(ShardStatus(node.id, rank, e.gpus, e.replica_id, pid=e.pid, port=e.port, endpoint=e.endpoint,
                                   state="started") for rank, (node, e) in enumerate(found))
        started = [e.started_at for _, e in found if e.started_at is not None]
        return Replica(
            id=g.replica, model=model.name, profile=profile.name, placement=placement, generation=x.generation,
            fingerprint=x.fingerprint, state=ReplicaState.STARTING, shards=shards,
            created_at=min(started) if started else self.now, state_since=self.now, adopted=True,
            revision=x.revision, canary=x.canary,
        )
