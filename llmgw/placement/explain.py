"""`explain-placement`: why a model runs where it runs, or why it cannot run anywhere."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmgw.catalog import Catalog, Model, NodeId, Profile
from llmgw.engines.argv import holds_weights
from llmgw.inventory import Inventory
from llmgw.placement.capacity import NodeFree, free_capacity, node_reasons
from llmgw.placement.types import Placement, Shard


@dataclass(frozen=True)
class Candidate:
    """One (profile, node) pair judged for the head (rank 0). ``worker`` is set only for a profile
    whose workers are judged otherwise (a llama.cpp worker needs no disk): why the node could not
    be one, empty when it could."""

    profile: str
    node: str
    fits: bool
    reasons: tuple[str, ...]
    worker: tuple[str, ...] | None = None


def shard_lines(p: Placement, *, indent: str = "    ") -> list[str]:
    """What each node of a replica across nodes must hold, by rank: the head and its workers. None
    for a single-node replica (its one line says it all)."""
    if len(p.shards) < 2:
        return []
    return [indent + shard_text(s, p) for s in p.shards]


def shard_text(s: Shard, p: Placement) -> str:
    role = "head" if s.rank == 0 else "worker"
    gpus = f"gpus {list(s.gpus)}" if s.gpus else "no GPU"
    if not s.holds_weights:
        holds = "no weights (the head sends its layers)"
    elif p.weights is None:
        holds = "the operator's own copy of the weights"
    else:
        holds = f"the weights of {p.model} ({p.size_gb:g} GB)"
    ram = f", {p.memory_gb:g} GB RAM" if p.memory_gb else ""
    return f"rank {s.rank} ({role}) on {s.node}: {gpus}{ram}, {holds}"


@dataclass(frozen=True)
class Explanation:
    model: str
    running: tuple[Placement, ...]
    candidates: tuple[Candidate, ...]

    def lines(self) -> list[str]:
        """The explanation as text, one line per fact, for the CLI and the dashboard."""
        out = [f"model {self.model}: {len(self.running)} replica(s) placed"]
        for p in self.running:
            where = ", ".join(f"{s.node} gpus {list(s.gpus)}" for s in p.shards)
            out.append(f"  running: profile {p.profile} on {where}")
            out += shard_lines(p)
        for c in self.candidates:
            verdict = "fits" if c.fits else "rejected: " + "; ".join(c.reasons)
            if c.worker is not None:
                as_worker = "fits" if not c.worker else "rejected: " + "; ".join(c.worker)
                verdict = f"as head {verdict}; as worker {as_worker}"
            out.append(f"  {c.profile} on {c.node}: {verdict}")
        return out


def explain(catalog: Catalog, inventory: Inventory, replicas: Iterable[Placement], model_name: str) -> Explanation:
    """Judge every (profile, node) pair of the model against the fleet as it is now."""
    model = catalog.resolve(model_name)
    if model is None:
        raise KeyError(model_name)
    placements = list(replicas)
    candidates = _candidates(model, free_capacity(inventory, placements))
    running = tuple(p for p in placements if p.model == model.name)
    return Explanation(model.name, running, candidates)


def _candidates(model: Model, free: Mapping[NodeId, NodeFree]) -> tuple[Candidate, ...]:
    return tuple(Candidate(profile.name, node_id, not reasons, tuple(reasons),
                           _as_worker(model, profile, free[node_id]))
                 for profile in model.profiles_by_priority() for node_id in sorted(free)
                 for reasons in (node_reasons(model, profile, free[node_id]),))


def _as_worker(model: Model, profile: Profile, nf: NodeFree) -> tuple[str, ...] | None:
    if not profile.sharded or holds_weights(profile, 1):
        return None
    return tuple(node_reasons(model, profile, nf, rank=1))


def unrunnable(catalog: Catalog, inventory: Inventory, names: Iterable[str]) -> dict[str, str]:
    """The models among ``names`` that no node could run even with the fleet idle, each with
    the reason in `llmgw explain`'s words; the router answers those at once instead of holding
    a request for a replica that cannot come (DESIGN §6).

    A busy fleet is not "cannot run": capacity frees up, so such a model still holds. Before
    any node has reported, nothing is judged (a controller that just started knows nothing yet).
    """
    if not any(n.report is not None for n in inventory.nodes.values()):
        return {}
    idle = free_capacity(inventory, ())  # once per call: this runs on every reconcile tick
    out: dict[str, str] = {}
    for name in names:
        model = catalog.resolve(name)
        candidates = _candidates(model, idle) if model is not None else ()
        if model is not None and any(_runnable(p, candidates) for p in model.profiles):
            continue
        if not candidates:
            out[name] = "no node of this controller can run it (it manages none)"
            continue
        assert model is not None
        # A profile across nodes whose nodes each fit but are too few says so first: its fitting
        # candidates have no reason of their own to show.
        few = [f"{p.name} spans {p.nodes} nodes, only {n} could take a shard" for p in model.profiles
               if p.sharded for n in (_able(p, candidates),) if n]
        rejected = [c for c in candidates if not c.fits]
        shown = few + [f"{c.profile} on {c.node}: {'; '.join(c.reasons)}" for c in rejected[:3]]
        more = f" (and {len(rejected) - 3} more)" if len(rejected) > 3 else ""
        out[name] = "no node can run it: " + " | ".join(shown) + more
    return out


def _runnable(profile: Profile, candidates: tuple[Candidate, ...]) -> bool:
    """Whether ``profile`` has nodes enough for a whole replica: a head, and as many other nodes
    able to take a worker as it has workers (one fitting node is not a replica of three)."""
    mine = [c for c in candidates if c.profile == profile.name]
    heads = [c.node for c in mine if c.fits]
    workers = {c.node for c in mine if (c.fits if c.worker is None else not c.worker)}
    return any(len(workers - {h}) >= profile.nodes - 1 for h in heads)


def _able(profile: Profile, candidates: tuple[Candidate, ...]) -> int:
    """Nodes that could take some shard of ``profile`` (as its head or as a worker)."""
    return len({c.node for c in candidates if c.profile == profile.name and (c.fits or c.worker == ())})
