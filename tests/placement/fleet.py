"""Build inventories and catalogs for placement tests without any I/O."""

from __future__ import annotations

from llmgw.catalog import Catalog, Model, ModelName, NodeId, NodeSpec, Profile, Scaling, cache_name
from llmgw.catalog.model import GpuSpec
from llmgw.inventory import Filesystem, Gpu, Inventory, Node, NodeReport, NodeState, WeightEntry

GB = 1024**3


def node(
    node_id: str,
    *,
    gpus: int = 8,
    cls: str = "h100",
    mem: float = 80,
    pool: str = "default",
    fabric: str | None = None,
    state: NodeState = NodeState.READY,
    disk_gb: float = 1000,
    shared: bool = False,
    held: tuple[str, ...] = (),
    ram_gb: float = 1024,
    unhealthy: dict[int, str] | None = None,
    reported: bool = True,
) -> Node:
    unhealthy = unhealthy or {}
    report = NodeReport(
        hostname=node_id,
        agent_version="0.1.0",
        gpus=tuple(
            Gpu(i, cls, mem, healthy=i not in unhealthy, problems=(unhealthy[i],) if i in unhealthy else ())
            for i in range(gpus)
        ),
        memory_total_mb=int(ram_gb * 1024),
        memory_available_mb=int(ram_gb * 1024),
        filesystems=(Filesystem("/var/cache/llmgw", "/", "nfs" if shared else "ext4", int(4000 * GB),
                                int(disk_gb * GB), shared),),
        weights=tuple(WeightEntry(f"/var/cache/llmgw/{cache_name(s)}", cache_name(s), s, 1) for s in held),
    )
    # nodes.yaml declares what the agent reports (a test of a disagreement replaces one of them).
    spec = NodeSpec(NodeId(node_id), f"10.0.0.{abs(hash(node_id)) % 250}", pool=pool, fabric=fabric,
                    gpus=GpuSpec(gpus, cls, mem) if gpus else None)
    return Node(spec, state, report if reported else None, last_seen=0.0)


def inventory(*nodes: Node) -> Inventory:
    return Inventory({n.id: n for n in nodes})


def model(
    name: str,
    *profiles: Profile,
    size_gb: float = 16,
    source: str | None = None,
    min_: int = 1,
) -> Model:
    return Model(
        name=ModelName(name),
        source=source or f"hf://org/{name}",
        size_gb=size_gb,
        profiles=profiles,
        scaling=Scaling(min=min_, max=max(min_, 1)),
    )


def profile(name: str = "gpu", *, priority: int = 0, gpus: int = 1, **kw) -> Profile:
    return Profile(name=name, priority=priority, engine=kw.pop("engine", "vllm"), gpus=gpus, **kw)


def catalog(*models: Model) -> Catalog:
    return Catalog(models=models)
