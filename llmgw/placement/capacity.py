"""What each node has free, and why a node cannot hold one shard of a profile.

`node_reasons` is the one judgement of a (profile, node) pair: the fast path in
`place` and the full scan in `explain` both call it, so an explanation can never
disagree with a decision.
"""

from __future__ import annotations

import posixpath
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmgw.catalog import Model, NodeId, Profile
from llmgw.catalog.model import is_operator_path
from llmgw.engines.argv import holds_weights, shard_engine
from llmgw.inventory import Gpu, Inventory, Node, NodeState
from llmgw.inventory.model import GB, gpu_groups
from llmgw.placement.types import Placement

# Said of a reason no amount of waiting fixes: the node lacks it outright, not for now.
NEVER = "never fits on this node"


@dataclass
class NodeFree:
    """Mutable during one placement pass: it shrinks as shards are placed."""

    node: Node
    free: dict[int, Gpu]  # healthy GPUs no replica uses, by index
    unhealthy: tuple[Gpu, ...]
    in_use: int
    ram_gb: float
    disk_gb: float
    held: set[str] = field(default_factory=set)

    @property
    def id(self) -> NodeId:
        return self.node.id


def _ram_gb(node: Node) -> float:
    # The operator's declaration wins over what the machine reports: it is how much of
    # the box llmgw may use.
    if node.spec.memory_gb is not None:
        return float(node.spec.memory_gb)
    return node.report.memory_total_mb / 1024 if node.report else 0.0


def free_capacity(inventory: Inventory, placements: Iterable[Placement]) -> dict[NodeId, NodeFree]:
    """Free resources per node after the given replicas take theirs."""
    out: dict[NodeId, NodeFree] = {}
    for node in inventory.nodes.values():
        report = node.report
        gpus = report.gpus if report else ()
        out[node.id] = NodeFree(
            node=node,
            free={g.index: g for g in gpus if g.healthy},
            unhealthy=tuple(g for g in gpus if not g.healthy),
            in_use=0,
            ram_gb=_ram_gb(node),
            disk_gb=report.local_free_gb if report else 0.0,
            held=set(report.held) if report else set(),
        )
    for p in placements:
        for shard in p.shards:
            nf = out.get(shard.node)
            if nf is None:
                continue
            for i in shard.gpus:
                if nf.free.pop(i, None) is not None:
                    nf.in_use += 1
            nf.ram_gb -= p.memory_gb
            if p.weights and shard.holds_weights and p.weights not in nf.held:
                # Being fetched: the download will take this room even if it has not yet.
                nf.disk_gb -= p.size_gb
                nf.held.add(p.weights)
    return out


def matching_gpus(profile: Profile, nf: NodeFree) -> list[int]:
    """Free GPU indices on the node of an allowed class with the memory asked, lowest first."""
    return sorted(
        i for i, g in nf.free.items()
        if (not profile.gpu_class or g.gpu_class in profile.gpu_class)
        and (profile.gpu_memory_gb is None or g.memory_gb >= profile.gpu_memory_gb)
    )


def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"


def _state_reason(node: Node) -> str | None:
    if node.state == NodeState.READY:
        return None if node.report is not None else "has not reported an inventory"
    if node.state == NodeState.UNREACHABLE:
        return f"is unreachable ({node.error})" if node.error else "is unreachable"
    if node.state == NodeState.UNKNOWN:
        return "has not reported an inventory"
    if node.state == NodeState.FENCED:
        return "is fenced: another controller drives it"
    if node.state == NodeState.HANDOVER:
        return "is being handed over from another instance of this controller"
    return f"is {node.state.value}"


def node_reasons(model: Model, profile: Profile, nf: NodeFree, *, rank: int = 0) -> list[str]:
    """Why ``nf`` cannot hold the shard of ``profile`` of this ``rank``; empty when it can. Rank 0
    (the head, the only shard of a single-node profile) is the strictest: a llama.cpp worker needs
    no room for the weights."""
    node = nf.node
    state = _state_reason(node)
    if state:
        return [f"node {state}"]
    reasons = []
    if profile.pool and node.spec.pool != profile.pool:
        reasons.append(f'pool "{profile.pool}" wanted, node is in "{node.spec.pool}"')
    if profile.sharded and node.spec.fabric != profile.fabric:
        reasons.append(f"fabric {profile.fabric} wanted, node has {node.spec.fabric or 'none'}")
    if profile.gpus > 0:
        usable = matching_gpus(profile, nf)
        if len(usable) < profile.gpus:
            reasons.append(_gpu_reason(profile, nf, len(usable)))
    if profile.memory_gb and nf.ram_gb < profile.memory_gb:
        ram = _ram_gb(node)
        reasons.append(f"node has {_fmt(ram)} GB RAM in all, needs {_fmt(profile.memory_gb)}: {NEVER}"
                       if ram < profile.memory_gb else
                       f"needs {_fmt(profile.memory_gb)} GB RAM free, has {_fmt(max(nf.ram_gb, 0))}")
    reasons += offer_reasons(model, profile, node, rank=rank)
    weights = model.cache_name if holds_weights(profile, rank) else None
    # A node holding the file needs no room for it; an operator's own copy is never fetched.
    if weights is not None and weights not in nf.held and nf.disk_gb < model.size_gb:
        reasons.append(_disk_reason(model, nf))
    return reasons


def offer_reasons(model: Model, profile: Profile, node: Node, *, rank: int = 0) -> list[str]:
    """What the node's owner does not offer this shard (its engines, where it reads weights from),
    from its report: the node would refuse the start, so the plan must not promise it (seen:
    `llmgw diff` said "start" four times, and the node refused four times)."""
    offers = node.report.offers if node.report else None
    if offers is None:
        return []  # an agent older than the report: the node's answer to the start says it
    reasons = []
    confinement = node.report.confinement if node.report else None
    if confinement is not None and confinement.problem:
        reasons.append(f"node refuses every start until its owner fixes its sandbox: {confinement.problem}")
    env_allow = node.report.env_allow if node.report else ()
    # The start's env is the profile's (the fabric's own names are the agents' defaults): a name the
    # node's env_allow lacks is refused there, so it is said here, with the setting that decides.
    refused_env = sorted(k for k, _ in profile.env if k not in env_allow) if env_allow else []
    if refused_env:
        reasons.append(f"node does not allow env {', '.join(refused_env)} (its env_allow): {NEVER}")
    owners = sorted(k for k, _ in profile.env if k in offers.owner_env)
    if owners:
        reasons.append(f"env {', '.join(owners)} is set by the node's owner only (its engine_env), whatever env_allow "
                       f"says: {NEVER}")
    engine = shard_engine(profile, rank)
    if engine not in offers.engines:
        reasons.append(f"node has no {engine} engine (its agent config has {', '.join(offers.engines) or 'none'}): "
                       f"{NEVER}")
    if not holds_weights(profile, rank):
        return reasons
    if is_operator_path(model.source) and not _inside_any(model.source, offers.model_dirs):
        reasons.append(f"node reads a plain-path source only inside its model_dirs, and {model.source} is not: "
                       f"{NEVER}")
    elif model.source.startswith("file://"):
        path = posixpath.normpath(urllib.parse.unquote(urllib.parse.urlsplit(model.source).path))
        if not _inside_any(path, offers.local_roots):
            reasons.append(f"node copies file:// sources only from its local_sources and model_dirs, and {path} "
                           f"is in neither: {NEVER}")
    return reasons


def _inside_any(path: str, roots: Iterable[str]) -> bool:
    path = posixpath.normpath(path)
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in map(posixpath.normpath, roots))


def _disk_reason(model: Model, nf: NodeFree) -> str:
    fs = nf.node.report.cache_fs if nf.node.report else None
    if fs is not None and not fs.shared and fs.total_bytes / GB < model.size_gb:
        # Nothing freed on it makes room: the filesystem is smaller than the weights.
        return (f"node's local disk for the weights holds {_fmt(fs.total_bytes / GB)} GB in all, needs "
                f"{_fmt(model.size_gb)}: {NEVER}")
    # A shared cache is not "never": weights another node fetches there are held here too.
    shared = " (its cache is on a shared filesystem, not counted)" if fs is not None and fs.shared else ""
    return f"needs {_fmt(model.size_gb)} GB free local disk for the weights, has {_fmt(max(nf.disk_gb, 0))}{shared}"


def _gpu_reason(profile: Profile, nf: NodeFree, usable: int) -> str:
    """Why the node's GPUs do not take the profile. When the node lacks the class, the count or the
    memory outright, the reason says it never fits here: "needs 1 free GPU of class l40s … 2 in use"
    on a node with no l40s at all read as "wait for one to free up"."""
    node = nf.node
    note = node.gpu_disagreement
    agent = [f"{note}: placement counts the agent's"] if note else []
    never = _never_reason(profile, node.report.gpus if node.report else ())
    if never is not None:
        text, details = never
        details += agent
        paren = f" ({'; '.join(details)})" if details else ""
        return f"{text}{paren}: {NEVER}"
    want = f"{profile.gpus} free GPU{'s' if profile.gpus != 1 else ''}{_asked(profile)}"
    total = len(nf.free) + nf.in_use + len(nf.unhealthy)
    detail = [f"{nf.in_use} in use"] if nf.in_use else []
    if nf.unhealthy:
        why = "; ".join(f"gpu{g.index}: {', '.join(g.problems) or 'unhealthy'}" for g in nf.unhealthy)
        detail.append(f"{len(nf.unhealthy)} unhealthy ({why})")
    other = len(nf.free) - usable
    if other:
        classes = sorted({g.gpu_class for g in nf.free.values()})
        detail.append(f"{other} free but of class {'/'.join(classes)} or too small")
    tail = f" (of {total}: {', '.join(detail)}" if detail else f" (of {total}"
    tail += "".join(f"; {a}" for a in agent) + ")"
    return f"needs {want}, has {usable}{tail}"


def _asked(profile: Profile) -> str:
    out = f" of class {'|'.join(profile.gpu_class)}" if profile.gpu_class else ""
    return out + (f" with {_fmt(profile.gpu_memory_gb)} GB" if profile.gpu_memory_gb else "")


def _never_reason(profile: Profile, gpus: tuple[Gpu, ...]) -> tuple[str, list[str]] | None:
    """(reason, details) when the node's GPUs, every one of them free and healthy, could not take the
    profile: no GPU of an allowed class, too few in all, or too little memory on each. None when
    waiting (for GPUs in use, or sick ones to recover) could help."""
    if not gpus:
        return "node has no GPUs", []
    of_class = [g for g in gpus if not profile.gpu_class or g.gpu_class in profile.gpu_class]
    classes = f" of class {'|'.join(profile.gpu_class)}" if profile.gpu_class else ""
    if not of_class:
        return f"node has no GPU{classes}", [f"it has {gpu_groups((g.gpu_class, None) for g in gpus)}"]
    want = profile.gpus
    if len(of_class) < want:
        return f"node has {len(of_class)} GPU{'s' if len(of_class) != 1 else ''}{classes} in all, needs {want}", []
    asked = profile.gpu_memory_gb
    capable = [g for g in of_class if asked is None or g.memory_gb >= asked]
    if len(capable) >= want:
        return None
    assert asked is not None  # only memory can leave fewer capable than of the class
    if not capable:
        most = max(g.memory_gb for g in of_class)
        each = "each" if all(g.memory_gb == most for g in of_class) else "at most"
        return f"node's GPUs{classes} have {_fmt(most)} GB {each}, needs {_fmt(asked)} GB per GPU", []
    many = "s" if len(capable) != 1 else ""
    return f"node has {len(capable)} GPU{many}{classes} with {_fmt(asked)} GB in all, needs {want}", []
