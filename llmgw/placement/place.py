"""Placement: a pure function of (catalog, inventory, replicas) → decisions and rejections.

It never calls the clock, the network or the disk; the reconciler applies what it
returns and `llmgw diff` prints it, so both show the same plan.

For each replica wanted, a model's profiles are tried in priority order. A node that
already holds the weights is preferred (no download, no disk), then the node the shard
fits most tightly (best fit keeps whole nodes free for the big models). Finding a node
goes through an index of free GPU counts rather than a scan of the fleet, so a pass on
thousands of nodes costs what the replicas placed cost, not nodes × models; the full
per-node judgement (`node_reasons`) still decides every chosen node, and a model that
cannot be placed gets the full scan so every rejected candidate carries its reason.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from itertools import islice

from llmgw.catalog import Catalog, Model, ModelName, NodeId, Profile
from llmgw.engines.argv import holds_weights
from llmgw.inventory import Inventory
from llmgw.placement.capacity import NodeFree, free_capacity, matching_gpus, node_reasons
from llmgw.placement.types import Placement, PlacementResult, Rejection, Shard

GroupKey = tuple[str, str, float]  # (pool, gpu class, GPU memory GB)


class _Index:
    """Schedulable nodes bucketed by (pool, class, memory) and free GPU count."""

    def __init__(self, free: Mapping[NodeId, NodeFree]) -> None:
        self.free = free
        self.buckets: dict[GroupKey, dict[int, dict[NodeId, None]]] = defaultdict(lambda: defaultdict(dict))
        self.where: dict[NodeId, dict[GroupKey, int]] = defaultdict(dict)
        self.by_pool: dict[str, list[NodeId]] = defaultdict(list)
        self.holders: dict[str, list[NodeId]] = defaultdict(list)
        for node_id in sorted(free):
            nf = free[node_id]
            if not nf.node.schedulable:
                continue
            self.by_pool[nf.node.spec.pool].append(node_id)
            for name in nf.held:
                self.holders[name].append(node_id)
            self._file(node_id)

    def _groups(self, nf: NodeFree) -> dict[GroupKey, int]:
        counts: dict[GroupKey, int] = defaultdict(int)
        for g in nf.free.values():
            counts[(nf.node.spec.pool, g.gpu_class, g.memory_gb)] += 1
        return counts

    def _file(self, node_id: NodeId) -> None:
        for key, count in self.where.pop(node_id, {}).items():
            self.buckets[key][count].pop(node_id, None)
        groups = self._groups(self.free[node_id])
        for key, count in groups.items():
            self.buckets[key][count][node_id] = None
        self.where[node_id] = groups

    def refile(self, node_id: NodeId) -> None:
        self._file(node_id)

    def candidates(self, profile: Profile) -> Iterable[NodeId]:
        """Nodes that may have room for one GPU shard, tightest fit first."""
        keys = [
            k for k in self.buckets
            if (not profile.pool or k[0] == profile.pool)
            and (not profile.gpu_class or k[1] in profile.gpu_class)
            and (profile.gpu_memory_gb is None or k[2] >= profile.gpu_memory_gb)
        ]
        if not keys:
            return
        top = max((max(self.buckets[k], default=0) for k in keys), default=0)
        seen: set[NodeId] = set()
        for count in range(max(profile.gpus, 1), top + 1):
            for k in keys:
                bucket = self.buckets[k].get(count)
                start = 0
                # Copied a few at a time, not whole: a bucket can hold most of a large
                # fleet, and the first node in it usually fits. (The caller may refile
                # the node it takes, which changes the bucket under us.)
                while bucket:
                    chunk = list(islice(bucket, start, start + 16))
                    if not chunk:
                        break
                    start += len(chunk)
                    for node_id in chunk:
                        if node_id not in seen:
                            seen.add(node_id)
                            yield node_id


def _tightness(profile: Profile, nf: NodeFree) -> tuple[float, str]:
    if profile.gpus > 0:
        return (len(matching_gpus(profile, nf)) - profile.gpus, nf.id)
    return (nf.ram_gb - (profile.memory_gb or 0), nf.id)


def _pick(model: Model, profile: Profile, index: _Index, count: int, exclude: set[NodeId]) -> list[NodeId]:
    """Up to ``count`` nodes for the shards of one replica, in rank order: weight holders, then best
    fit. Each node is judged for the rank it would take (the next free one), so a llama.cpp head
    lands where the weights are or fit, and its workers wherever memory is."""
    free = index.free
    chosen: list[NodeId] = []

    def ok(node_id: NodeId) -> bool:
        return node_id not in exclude and node_id not in chosen and \
            not node_reasons(model, profile, free[node_id], rank=len(chosen))

    if model.cache_name:
        holders = sorted((n for n in index.holders.get(model.cache_name, ()) if ok(n)),
                         key=lambda n: _tightness(profile, free[n]))
        chosen.extend(holders[:count])
    while len(chosen) < count:
        # One pass per rank judgement: the head (rank 0) may need disk that workers do not.
        before = len(chosen)
        if profile.gpus > 0:
            for node_id in index.candidates(profile):
                if ok(node_id):
                    chosen.append(node_id)
                    if len(chosen) == count or (len(chosen) == 1 and not holds_weights(profile, 1)):
                        break
        else:
            pool = [index.by_pool[profile.pool]] if profile.pool else list(index.by_pool.values())
            fits = sorted((n for nodes in pool for n in nodes if ok(n)), key=lambda n: _tightness(profile, free[n]))
            take = 1 if not chosen and not holds_weights(profile, 1) else count - len(chosen)
            chosen.extend(fits[:take])
        if len(chosen) == before:
            break
    return chosen


def _take(model: Model, profile: Profile, nodes: list[NodeId], index: _Index) -> Placement:
    shards = []
    for rank, node_id in enumerate(nodes):
        nf = index.free[node_id]
        gpus = tuple(matching_gpus(profile, nf)[: profile.gpus])
        for i in gpus:
            del nf.free[i]
        nf.in_use += len(gpus)
        nf.ram_gb -= profile.memory_gb or 0
        holds = holds_weights(profile, rank)
        if holds and model.cache_name and model.cache_name not in nf.held:
            nf.disk_gb -= model.size_gb
            nf.held.add(model.cache_name)
            index.holders[model.cache_name].append(node_id)
        index.refile(node_id)
        shards.append(Shard(node_id, rank, gpus, holds_weights=holds))
    return Placement(
        model=model.name, profile=profile.name, shards=tuple(shards),
        memory_gb=float(profile.memory_gb or 0), size_gb=model.size_gb, weights=model.cache_name,
    )


def default_wanted(catalog: Catalog, placements: Iterable[Placement]) -> dict[str, int]:
    """Replicas each model lacks to reach its ``scaling.min``."""
    have: dict[str, int] = defaultdict(int)
    for p in placements:
        have[p.model] += 1
    return {m.name: max(0, m.scaling.min - have[m.name]) for m in catalog.models}


def place(
    catalog: Catalog,
    inventory: Inventory,
    replicas: Iterable[Placement],
    *,
    now: float,  # noqa: ARG001 - part of the contract: time is an argument, never read here
    wanted: Mapping[str, int] | None = None,
    avoid: Mapping[str, Iterable[NodeId]] | None = None,
    reasons: bool = True,
) -> PlacementResult:
    """Place ``wanted`` new replicas per model (default: up to ``scaling.min``).

    ``replicas`` are the placements already holding resources. ``avoid`` keeps a model's
    new replicas off given nodes (a replacement must not land where the old one runs).
    With ``reasons`` false, models that cannot be placed are counted but their rejected
    candidates are not listed: judging every node for every such model is most of the
    cost of a pass on a full fleet, and the reconciler's tick only needs the count
    (`explain` judges one model on demand).
    """
    existing = list(replicas)
    want = default_wanted(catalog, existing) if wanted is None else dict(wanted)
    free = free_capacity(inventory, existing)
    index = _Index(free)
    placed: list[Placement] = []
    unplaced: dict[str, int] = {}
    for model in catalog.models:
        n = want.get(model.name, 0)
        exclude = set((avoid or {}).get(model.name, ()))
        for _ in range(n):
            placement = None
            for profile in model.profiles_by_priority():
                nodes = _pick(model, profile, index, profile.nodes, exclude)
                if len(nodes) == profile.nodes:
                    placement = _take(model, profile, nodes, index)
                    break
            if placement is None:
                unplaced[model.name] = unplaced.get(model.name, 0) + 1
            else:
                placed.append(placement)
    rejections: list[Rejection] = []
    for name in unplaced if reasons else ():
        unplaced_model = catalog.model(name)
        if unplaced_model is not None:
            rejections.extend(judge_all(unplaced_model, free, exclude=set((avoid or {}).get(name, ()))))
    return PlacementResult(tuple(placed), tuple(rejections), unplaced)


def judge_all(model: Model, free: Mapping[NodeId, NodeFree], *, exclude: set[NodeId] | None = None) -> list[Rejection]:
    """Every (profile, node) candidate of ``model`` that cannot hold a shard, with its reasons."""
    out = []
    for profile in model.profiles_by_priority():
        for node_id in sorted(free):
            if exclude and node_id in exclude:
                out.append(Rejection(model.name, profile.name, node_id, "node is being replaced away from"))
                continue
            reasons = node_reasons(model, profile, free[node_id])
            if reasons:
                out.append(Rejection(ModelName(model.name), profile.name, node_id, "; ".join(reasons)))
    return out
