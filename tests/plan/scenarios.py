"""A base catalog in a real repository and a fleet snapshot that runs it, for `llmgw diff` tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

from llmgw.catalog import NodeId, NodeSpec, cache_name
from llmgw.catalog.model import GpuSpec
from llmgw.decide.replica import Replica, ReplicaState, ShardStatus
from llmgw.inventory import Filesystem, Gpu, Inventory, Node, NodeReport, NodeState, WeightEntry
from llmgw.placement import Placement, Shard
from llmgw.plan import FleetSnapshot

GB = 1024**3
FIXED_DATES = {"GIT_AUTHOR_DATE": "2026-11-30T12:00:00Z", "GIT_COMMITTER_DATE": "2026-11-30T12:00:00Z"}

NODES = """\
# yaml-language-server: $schema=../schemas/nodes.schema.json
nodes:
  - id: n1
    address: 10.0.0.1
    gpus: {count: 2, class: sim, memory_gb: 24}
    disk_gb: 100
  - id: n2
    address: 10.0.0.2
    gpus: {count: 2, class: sim, memory_gb: 24}
    disk_gb: 100
  - id: n3
    address: 10.0.0.3
    gpus: {count: 2, class: sim, memory_gb: 24}
    disk_gb: 100
"""


def model(name: str, source: str, *, min_: int = 1, max_: int = 2, gpus: int = 1, aliases: str = "",
          args: str = "", size: float = 10) -> str:
    text = f"name: {name}\n"
    if aliases:
        text += f"aliases: [{aliases}]\n"
    text += (f"source: {source}\nsize_gb: {size:g}\nscaling:\n  min: {min_}\n  max: {max_}\n"
             f"profiles:\n  - name: sim\n    engine: sim\n    gpus: {gpus}\n    gpu_class: [sim]\n")
    if args:
        text += f"    args: [{args}]\n"
    return text


CHAT = model("chat", "hf://org/chat@v1", aliases="gpt-4o-mini")
EMBED = model("embed", "hf://org/embed@v1")
OLD = model("old", "/models/old")  # an operator's own copy: never fetched, never an orphan

BASE = {"nodes.yaml": NODES, "models/chat.yaml": CHAT, "models/embed.yaml": EMBED, "models/old.yaml": OLD}


def _replica(rid: str, name: str, source: str, node: str, gpu: int, gen: int, fp_model: str) -> Replica:
    from llmgw.catalog import read_directory, validate_files  # noqa: F401 - fingerprint from the real model

    return Replica(
        id=rid, model=name, profile="sim",
        placement=Placement(name, "sim", (Shard(node, 0, (gpu,)),), size_gb=10,
                            weights=None if source.startswith("/") else cache_name(source)),
        generation=gen, fingerprint=fp_model, state=ReplicaState.READY,
        shards=(ShardStatus(node, 0, (gpu,), f"{rid}.r0", pid=1000 + gen, port=20000 + gen,
                            endpoint=f"http://10.0.0.{node[1]}:{20000 + gen}", state="started"),),
        created_at=0.0, state_since=0.0, ready_since=0.0,
    )


def fleet(base_catalog) -> FleetSnapshot:  # noqa: ANN001 - a Catalog
    """n1 runs chat and embed, n2 runs old; each node holds what it runs."""
    from llmgw.decide.replica import fingerprint

    fp = {m.name: fingerprint(m, m.profiles[0]) for m in base_catalog.models}
    reps = (
        _replica("chat-g1", "chat", "hf://org/chat@v1", "n1", 0, 1, fp["chat"]),
        _replica("embed-g2", "embed", "hf://org/embed@v1", "n1", 1, 2, fp["embed"]),
        _replica("old-g3", "old", "/models/old", "n2", 0, 3, fp["old"]),
    )
    held = {"n1": ["hf://org/chat@v1", "hf://org/embed@v1"], "n2": [], "n3": []}
    nodes = {}
    for i in (1, 2, 3):
        nid = f"n{i}"
        report = NodeReport(
            hostname=nid, agent_version="0.1.0",
            gpus=(Gpu(0, "sim", 24.0, declared=True), Gpu(1, "sim", 24.0, declared=True)),
            memory_total_mb=16384, memory_available_mb=16384,
            filesystems=(Filesystem("/var/cache/llmgw", "/", "ext4", 100 * GB, (100 - 10 * len(held[nid])) * GB,
                                    False),),
            weights=tuple(WeightEntry(f"/var/cache/llmgw/{cache_name(s)}", cache_name(s), s, 10 * GB)
                          for s in held[nid]),
        )
        spec = NodeSpec(NodeId(nid), f"10.0.0.{i}", gpus=GpuSpec(2, "sim", 24.0), disk_gb=100)
        nodes[nid] = Node(spec, NodeState.READY, report, last_seen=0.0)
    return FleetSnapshot(Inventory(nodes), reps, 0.0)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def base_repo(path: Path) -> Path:
    """A git repository at ``path`` holding BASE as its one commit, tagged ``base`` (fixed dates:
    the same shas in every run)."""
    from tests.conftest import git

    path.mkdir()
    git(path, "init", "-q", "-b", "main", env=FIXED_DATES)
    for rel, text in BASE.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "Base catalog", env=FIXED_DATES)
    git(path, "tag", "base")
    return path
