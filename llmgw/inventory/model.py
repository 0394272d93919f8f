"""What the fleet actually is: node records built from agent inventories plus node state.

Pure data. The dispatcher fetches agent answers; `parse_report` turns one into a
`NodeReport`; the store (llmgw.inventory.store) keeps the latest per node with its state.
A snapshot (`Inventory`) is what placement, `llmgw diff` and the admin API read, and it
round-trips through JSON so CI without access to the fleet can plan against an export.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

from llmgw.catalog import NodeId, NodeSpec
from llmgw.catalog.model import GpuSpec

GB = 1024**3


class NodeState(str, Enum):
    READY = "ready"
    CORDONED = "cordoned"  # no new placements; what runs stays
    DRAINING = "draining"  # replicas move elsewhere, then stop
    UNREACHABLE = "unreachable"
    UNKNOWN = "unknown"  # never reported
    FENCED = "fenced"  # its lease is held by another controller: this one neither starts nor stops there
    # Its lease is held by an earlier instance of this very controller (same holder id, from its
    # data dir), silent since: a restart after a crash. Nothing is started or stopped there and its
    # replicas are kept, not given up, until the lease's grace passes and the node is this one's;
    # a copy of the data dir that keeps renewing turns this into FENCED.
    HANDOVER = "handover"


@dataclass(frozen=True)
class Gpu:
    index: int
    gpu_class: str
    memory_gb: float
    healthy: bool = True
    problems: tuple[str, ...] = ()
    declared: bool = False


@dataclass(frozen=True)
class Filesystem:
    path: str
    mount_point: str
    fstype: str
    total_bytes: int
    free_bytes: int
    shared: bool


@dataclass(frozen=True)
class WeightEntry:
    path: str
    name: str | None
    source: str | None
    bytes: int
    last_used: float | None = None


@dataclass(frozen=True)
class EngineRecord:
    replica_id: str
    pid: int | None
    port: int | None
    endpoint: str | None
    engine: str
    alive: bool
    exit_code: int | None = None
    labels: tuple[tuple[str, str], ...] = ()
    weights: str | None = None
    started_at: float | None = None
    log_tail: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    holder: str | None = None  # the controller whose lease the node obeyed when it started this
    epoch: int | None = None
    listening: bool = False  # an rpc-server (a llama.cpp worker) whose port accepts connections
    # Sockets listening on its port that none of its processes hold (another engine on the same
    # port by SO_REUSEPORT: the kernel shares the connections); None: not told.
    port_shared_with: int | None = None

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


# The labels the reconciler starts every engine with (llmgw.reconciler.lifecycle). They say enough
# to rebuild the replica's record from what the agents report (llmgw.decide.adopt): a controller
# with no record of an engine (a new leader, a restored older copy of its data dir, an empty one)
# adopts it instead of starting another beside it.
LABEL_REPLICA = "llmgw.replica"
LABEL_MODEL = "llmgw.model"
LABEL_PROFILE = "llmgw.profile"
LABEL_RANK = "llmgw.rank"
LABEL_SHARDS = "llmgw.shards"
LABEL_GENERATION = "llmgw.generation"
LABEL_FINGERPRINT = "llmgw.fingerprint"
LABEL_CANARY = "llmgw.canary"
LABEL_REVISION = "llmgw.revision"
REPLICA_LABELS = (LABEL_REPLICA, LABEL_MODEL, LABEL_PROFILE, LABEL_RANK, LABEL_SHARDS, LABEL_GENERATION,
                  LABEL_FINGERPRINT, LABEL_CANARY)  # LABEL_REVISION may be empty: a catalog without one


@dataclass(frozen=True)
class EngineLabels:
    """What an engine's labels say of the replica it is one shard of (``rank`` of ``shards``)."""

    replica: str
    model: str
    profile: str
    rank: int
    shards: int
    generation: int
    fingerprint: str
    canary: bool = False
    revision: str | None = None

    def to_labels(self) -> dict[str, str]:
        """The labels a ``start`` request carries (the agent keeps and reports them as given)."""
        return {LABEL_REPLICA: self.replica, LABEL_MODEL: self.model, LABEL_PROFILE: self.profile,
                LABEL_RANK: str(self.rank), LABEL_SHARDS: str(self.shards), LABEL_GENERATION: str(self.generation),
                LABEL_FINGERPRINT: self.fingerprint, LABEL_CANARY: "true" if self.canary else "false",
                LABEL_REVISION: self.revision or ""}


def missing_labels(engine: EngineRecord) -> tuple[str, ...]:
    """The replica labels ``engine`` lacks or carries unreadable (an engine started by an llmgw
    older than adoption has no fingerprint, shard count or canary flag); () when it has them all."""
    labels = dict(engine.labels)
    numbers = {LABEL_RANK: 0, LABEL_SHARDS: 1, LABEL_GENERATION: 1}  # the least each may be
    out = []
    for key in REPLICA_LABELS:
        value = labels.get(key)
        if not value or (key in numbers and not (value.isascii() and value.isdigit() and int(value) >= numbers[key])) \
                or (key == LABEL_CANARY and value not in ("true", "false")):
            out.append(key)
    return tuple(out)


def engine_labels(engine: EngineRecord) -> EngineLabels | None:
    """The replica ``engine`` is a shard of, as its labels say; None when any is missing
    (:func:`missing_labels` says which)."""
    if missing_labels(engine):
        return None
    labels = dict(engine.labels)
    return EngineLabels(
        replica=labels[LABEL_REPLICA], model=labels[LABEL_MODEL], profile=labels[LABEL_PROFILE],
        rank=int(labels[LABEL_RANK]), shards=int(labels[LABEL_SHARDS]), generation=int(labels[LABEL_GENERATION]),
        fingerprint=labels[LABEL_FINGERPRINT], canary=labels[LABEL_CANARY] == "true",
        revision=labels.get(LABEL_REVISION) or None,
    )


def engine_is_ours(engine: EngineRecord, lease: Lease | None, *, holder: str | None) -> bool:
    """Whether this controller started ``engine`` (or an earlier life of it did) under the lease it
    holds now: what shutdown (`llmgw up` stops only its own) and `llmgw node takeover
    --stop-foreign` go by (DESIGN §4, fencing). Engines no record claims on a node whose lease this
    controller holds are judged by adoption instead (llmgw.decide.adopt), whoever started them.

    The node stamps each engine with the lease it obeyed. Ours: stamped with the lease this
    controller holds now, holder and epoch, since an epoch moves only when the node changes hands,
    so a copy of our data dir (same holder id) that drove the node before a takeover is not us.
    Unstamped (started where no lease was held) counts as ours; with no lease in the answer (an
    agent older than fencing, an unfenced dispatcher) only the holder id can tell.
    """
    if engine.holder is None:
        return True
    if lease is None:
        return engine.holder == holder
    return lease.held and engine.holder == lease.holder and engine.epoch == lease.epoch


@dataclass(frozen=True)
class Confinement:
    """How a node runs engines, as its agent reports it: the user, the sandbox, and why."""

    user: str
    sandbox: str  # "bwrap" or "none"
    detail: str = ""
    problem: str | None = None  # set: the node refuses every start, for this reason


@dataclass(frozen=True)
class Lease:
    """A node's lease as its agent reported it to this controller (DESIGN §4, fencing)."""

    holder: str | None
    epoch: int
    expires: float | None
    held: bool  # by the controller that asked (its holder id and this very instance of it)
    # Held by another instance of the asker's own holder id: a copy of its data dir, or its own
    # earlier life. ``heard`` is when that instance last spoke (node clock), ``grace`` how long a
    # silence lets the asker succeed it.
    sibling: bool = False
    heard: float | None = None
    grace: float | None = None


@dataclass(frozen=True)
class Offers:
    """What a node's owner lets engines use (its agent config): a start outside it is refused by
    the node, so placement, `explain` and `llmgw diff` say so first."""

    engines: tuple[str, ...] = ()  # engine names it can start
    local_roots: tuple[str, ...] = ()  # where file:// sources may be copied from (local_sources, model_dirs)
    model_dirs: tuple[str, ...] = ()  # where plain-path sources (an operator's copy) may lie
    owner_env: tuple[str, ...] = ()  # env names only the node's owner sets: a start naming one is refused


@dataclass(frozen=True)
class NodeReport:
    """One agent inventory answer, typed."""

    hostname: str
    agent_version: str
    gpus: tuple[Gpu, ...] = ()
    memory_total_mb: int = 0
    memory_available_mb: int = 0
    filesystems: tuple[Filesystem, ...] = ()
    weights: tuple[WeightEntry, ...] = ()
    foreign: tuple[str, ...] = ()
    engines: tuple[EngineRecord, ...] = ()
    confinement: Confinement | None = None
    env_allow: tuple[str, ...] = ()
    lease: Lease | None = None
    fabric_address: str | None = None  # where this node's shards of a multi-node replica meet the others
    offers: Offers | None = None  # None: an agent older than this report (nothing is checked)
    settings: str | None = None  # a digest of the node's config: it changes when its owner edits it
    peer_port: int | None = None  # where it serves its cache entries to other nodes (None: it does not)
    gpu_error: str | None = None  # its GPUs could not be read (nvidia-smi failed or timed out): ``gpus`` says nothing

    @property
    def cache_fs(self) -> Filesystem | None:
        """The filesystem of the cache dir (the agent reports it first)."""
        return self.filesystems[0] if self.filesystems else None

    @property
    def local_free_gb(self) -> float:
        """Free disk for new weights; a shared filesystem is not this node's to count."""
        fs = self.cache_fs
        return 0.0 if fs is None or fs.shared else fs.free_bytes / GB

    @property
    def held(self) -> frozenset[str]:
        return frozenset(w.name for w in self.weights if w.name)


@dataclass(frozen=True)
class Node:
    spec: NodeSpec
    state: NodeState = NodeState.UNKNOWN
    report: NodeReport | None = None
    last_seen: float | None = None
    unreachable_since: float | None = None
    error: str | None = None
    locked: bool = False
    # Fenced by a holder not heard from since this controller first saw the node (a killed or
    # paused controller): its lease lapses and the node, with its engines, becomes this one's.
    lapsing: bool = False

    @property
    def id(self) -> NodeId:
        return self.spec.id

    @property
    def gpu_disagreement(self) -> str | None:
        """What nodes.yaml and the agent say differently of its GPUs (:func:`gpu_disagreement`)."""
        return gpu_disagreement(self.spec, self.report)

    @property
    def schedulable(self) -> bool:
        return self.state == NodeState.READY and self.report is not None


@dataclass(frozen=True)
class Inventory:
    nodes: Mapping[str, Node] = field(default_factory=dict)
    taken_at: float | None = None

    def node(self, node_id: str) -> Node | None:
        return self.nodes.get(node_id)

    def to_json(self) -> dict[str, Any]:
        return {"taken_at": self.taken_at, "nodes": [_node_json(n) for n in self.nodes.values()]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Inventory:
        nodes: dict[str, Node] = {}
        for raw in data.get("nodes", []):
            node = _node_from_json(raw)
            nodes[node.id] = node
        return cls(nodes, data.get("taken_at"))


# A card reports more than its label in decimal GB (an H100 "80GB" 85.5, an A100 "40GB" 42.9): up to
# this share over what nodes.yaml declares is the label, not a disagreement. Less than declared always
# is one: a profile validated against the declaration would not fit.
GPU_MEMORY_OVER_LABEL = 0.10


def gpu_groups(gpus: Iterable[tuple[str, float | None]]) -> str:
    """``2 × sim 24 GB, 1 × h100 85.5 GB`` (``none`` for no GPU): (class, memory or None) pairs counted."""
    counts: dict[tuple[str, float | None], int] = {}
    for key in gpus:
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} × {cls}" + (f" {mem:g} GB" if mem is not None else "")
                     for (cls, mem), n in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))) or "none"


def gpu_disagreement(spec: NodeSpec, report: NodeReport | None) -> str | None:
    """How a node's GPUs in nodes.yaml and in its agent's report differ (count, class or memory), or
    None when they agree or the node has not reported.

    nodes.yaml is what `llmgw validate` checks profiles against; the agent's report (nvidia-smi, or
    the GPUs its own config declares) is what placement counts, because it is what the node has.
    Where they differ nothing else said so: a node declaring 2 × l40s whose agent reported none showed
    0/0 GPUs and took nothing, silently.
    """
    if report is None:
        return None
    declared = spec.gpus if spec.gpus is not None and spec.gpus.count > 0 else None
    reported = report.gpus
    said = gpu_groups((g.gpu_class, g.memory_gb) for g in reported)
    if declared is None:
        return f"nodes.yaml declares no GPUs, the agent reports {said}" if reported else None
    mine = f"nodes.yaml declares {gpu_groups([(declared.gpu_class, declared.memory_gb)] * declared.count)}"
    if not reported:
        return f"{mine}, the agent reports none"
    differs = (len(reported) != declared.count
               or any(g.gpu_class != declared.gpu_class or _memory_differs(g.memory_gb, declared.memory_gb)
                      for g in reported))
    return f"{mine}, the agent reports {said}" if differs else None


def _memory_differs(reported_gb: float, label_gb: float) -> bool:
    return reported_gb < label_gb - 0.05 or reported_gb > label_gb * (1 + GPU_MEMORY_OVER_LABEL)


def becomes_ours(node: Node) -> bool:
    """The node's lease is another's for now but falls to this controller once its silent holder's
    lease lapses (an earlier life of this one in handover, or a killed controller fenced): its
    replicas are kept, not lost, and its engines are adopted then, not replaced meanwhile (seen:
    two nodes' leases lapsing 0.15 s apart, a replica placed between them, an engine stopped after)."""
    return node.state == NodeState.HANDOVER or (node.state == NodeState.FENCED and node.lapsing)


def follow_nodes(nodes: Mapping[str, Node], specs: Iterable[NodeSpec]) -> dict[str, Node]:
    """The nodes of ``specs`` (nodes.yaml): what is known of a node that stays is kept under its
    new spec, a node that left is forgotten, a new one is known by its spec alone."""
    fresh: dict[str, Node] = {}
    for spec in specs:
        old = nodes.get(spec.id)
        fresh[spec.id] = replace(old, spec=spec) if old else Node(spec=spec)
    return fresh


def _node_json(n: Node) -> dict[str, Any]:
    out = asdict(n)
    out["state"] = n.state.value
    return out


def _node_from_json(raw: Mapping[str, Any]) -> Node:
    s = dict(raw["spec"])
    gpus = s.get("gpus")
    spec = NodeSpec(**{
        **s,
        "labels": tuple(tuple(x) for x in s.get("labels", ())),
        "gpus": GpuSpec(**gpus) if gpus else None,
    })
    r = raw.get("report")
    report = None
    if r:
        report = NodeReport(
            hostname=r["hostname"],
            agent_version=r["agent_version"],
            gpus=tuple(Gpu(**{**g, "problems": tuple(g.get("problems", ()))}) for g in r.get("gpus", ())),
            memory_total_mb=r.get("memory_total_mb", 0),
            memory_available_mb=r.get("memory_available_mb", 0),
            filesystems=tuple(Filesystem(**f) for f in r.get("filesystems", ())),
            weights=tuple(WeightEntry(**w) for w in r.get("weights", ())),
            foreign=tuple(r.get("foreign", ())),
            engines=tuple(_engine_from_json(e) for e in r.get("engines", ())),
            confinement=Confinement(**r["confinement"]) if r.get("confinement") else None,
            env_allow=tuple(r.get("env_allow", ())),
            lease=Lease(**r["lease"]) if r.get("lease") else None,
            fabric_address=r.get("fabric_address"),
            offers=parse_offers(r.get("offers")),
            settings=r.get("settings"),
            peer_port=r.get("peer_port"),
            gpu_error=r.get("gpu_error"),
        )
    return Node(
        spec=spec, state=NodeState(raw.get("state", "unknown")), report=report,
        last_seen=raw.get("last_seen"), unreachable_since=raw.get("unreachable_since"),
        error=raw.get("error"), locked=raw.get("locked", False), lapsing=raw.get("lapsing", False),
    )


def _engine_from_json(e: Mapping[str, Any]) -> EngineRecord:
    return EngineRecord(**{
        **e,
        "labels": tuple(tuple(x) for x in e.get("labels", ())),
        "log_tail": tuple(e.get("log_tail", ())),
        "gpus": tuple(e.get("gpus", ())),
    })


def parse_engine(raw: Mapping[str, Any]) -> EngineRecord:
    """An engine record as the agent's status/inventory reports it."""
    labels = raw.get("labels") or {}
    return EngineRecord(
        replica_id=str(raw.get("replica_id", "")),
        pid=raw.get("pid"),
        port=raw.get("port"),
        endpoint=raw.get("endpoint"),
        engine=str(raw.get("engine", "")),
        alive=bool(raw.get("alive")),
        exit_code=raw.get("exit_code"),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        weights=raw.get("weights"),
        started_at=raw.get("started_at"),
        log_tail=tuple(raw.get("log_tail") or ()),
        gpus=tuple(int(g) for g in raw.get("gpus") or ()),
        holder=raw["holder"] if isinstance(raw.get("holder"), str) else None,
        epoch=int(raw["epoch"]) if isinstance(raw.get("epoch"), int) else None,
        listening=raw.get("listening") is True,
        port_shared_with=raw["port_shared_with"] if type(raw.get("port_shared_with")) is int else None,
    )


def parse_report(raw: Mapping[str, Any]) -> NodeReport:
    """Type an agent `inventory` answer (DESIGN §4); unknown fields are ignored."""
    mem = raw.get("memory_mb") or {}
    if isinstance(mem, int | float):
        mem = {"total": mem, "available": mem}
    return NodeReport(
        hostname=str(raw.get("hostname", "")),
        agent_version=str(raw.get("agent_version", "")),
        gpus=tuple(
            Gpu(
                index=int(g["index"]),
                gpu_class=str(g.get("class", "")),
                memory_gb=float(g.get("memory_gb", 0)),
                healthy=bool(g.get("healthy", True)),
                problems=tuple(g.get("problems") or ()),
                declared=bool(g.get("declared", False)),
            )
            for g in raw.get("gpus") or ()
        ),
        memory_total_mb=int(mem.get("total") or 0),
        memory_available_mb=int(mem.get("available") or 0),
        filesystems=tuple(
            Filesystem(
                path=f["path"], mount_point=f.get("mount_point", ""), fstype=f.get("fstype", ""),
                total_bytes=int(f.get("total_bytes", 0)), free_bytes=int(f.get("free_bytes", 0)),
                shared=bool(f.get("shared", False)),
            )
            for f in raw.get("filesystems") or ()
        ),
        weights=tuple(
            WeightEntry(path=w["path"], name=w.get("name"), source=w.get("source"),
                        bytes=int(w.get("bytes", 0)), last_used=w.get("last_used"))
            for w in raw.get("weights") or ()
        ),
        foreign=tuple(raw.get("foreign") or ()),
        engines=tuple(parse_engine(e) for e in raw.get("engines") or ()),
        confinement=parse_confinement(raw.get("confinement")),
        env_allow=tuple(str(n) for n in raw.get("env_allow") or ()),
        lease=parse_lease(raw.get("lease")),
        fabric_address=raw["fabric_address"] if isinstance(raw.get("fabric_address"), str) else None,
        offers=parse_offers(raw.get("offers")),
        settings=raw["settings"] if isinstance(raw.get("settings"), str) else None,
        peer_port=raw["peer_port"] if type(raw.get("peer_port")) is int else None,
        gpu_error=str(raw["gpu_error"])[:500] if raw.get("gpu_error") else None,
    )


def parse_offers(raw: Any) -> Offers | None:
    if not isinstance(raw, Mapping):
        return None

    def strings(key: str) -> tuple[str, ...]:
        value = raw.get(key)
        return tuple(str(v) for v in value if isinstance(v, str)) if isinstance(value, list | tuple) else ()

    return Offers(strings("engines"), strings("local_roots"), strings("model_dirs"), strings("owner_env"))


def parse_lease(raw: Any) -> Lease | None:
    """None for an agent older than fencing, or a poll that asked for no lease."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("epoch"), int):
        return None
    holder = raw.get("holder")
    return Lease(holder=holder if isinstance(holder, str) else None, epoch=int(raw["epoch"]),
                 expires=_number(raw.get("expires")), held=raw.get("held") is True,
                 sibling=raw.get("sibling") is True, heard=_number(raw.get("heard")), grace=_number(raw.get("grace")))


def _number(raw: Any) -> float | None:
    return float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else None


def parse_confinement(raw: Any) -> Confinement | None:
    """None for an agent older than the node boundary (it reports none): shown as unknown."""
    if not isinstance(raw, Mapping):
        return None
    problem = raw.get("problem")
    return Confinement(user=str(raw.get("user", "")), sandbox=str(raw.get("sandbox", "none")),
                       detail=str(raw.get("detail", "")), problem=str(problem) if problem else None)
