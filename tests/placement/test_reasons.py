"""A rejection that no amount of waiting fixes says so: the node lacks the GPU class, the count or
the memory outright (seen: "needs 1 free GPU of class l40s … 2 in use" on a node with no l40s at
all, which read as "wait for a GPU to free up"). A busy node keeps the old, transient reason."""

from __future__ import annotations

from dataclasses import replace

from llmgw.catalog import NodeId, NodeSpec
from llmgw.catalog.model import GpuSpec
from llmgw.inventory import Gpu
from llmgw.placement import Shard, explain, place
from llmgw.placement.types import Placement
from tests.placement.fleet import catalog, inventory, model, node, profile

NEVER = ": never fits on this node"


def reason(m, n, running=()) -> str:  # noqa: ANN001 - a Model and a Node
    (candidate,) = explain(catalog(m), inventory(n), list(running), m.name).candidates
    assert not candidate.fits
    (text,) = candidate.reasons
    return text


def on(node_id: str, *gpus: int, model_name: str = "busy") -> Placement:
    return Placement(model_name, "gpu", (Shard(NodeId(node_id), 0, gpus),), size_gb=0, weights=None)


def test_a_node_without_the_class_says_it_has_none_and_what_it_has() -> None:
    m = model("m", profile(gpus=1, gpu_class=("l40s",)))
    # Both of its GPUs busy: still not "2 in use", since freeing them would not help.
    assert reason(m, node("sim-node", gpus=2, cls="sim", mem=24), [on("sim-node", 0, 1)]) == (
        "node has no GPU of class l40s (it has 2 × sim)" + NEVER)
    two = model("m", profile(gpus=1, gpu_class=("l40s", "a100")))
    assert reason(two, node("h", gpus=8)) == "node has no GPU of class l40s|a100 (it has 8 × h100)" + NEVER


def test_a_node_with_no_gpus_at_all_says_so() -> None:
    m = model("m", profile(gpus=1))
    assert reason(m, node("cpu", gpus=0)) == "node has no GPUs" + NEVER


def test_fewer_gpus_in_all_than_the_profile_wants() -> None:
    assert reason(model("m", profile(gpus=16)), node("h", gpus=8)) == "node has 8 GPUs in all, needs 16" + NEVER
    with_class = model("m", profile(gpus=4, gpu_class=("h100",)))
    assert reason(with_class, node("h", gpus=2)) == "node has 2 GPUs of class h100 in all, needs 4" + NEVER


def test_too_little_memory_per_gpu() -> None:
    m = model("m", profile(gpus=1, gpu_class=("h100",), gpu_memory_gb=40))
    assert reason(m, node("small", mem=24)) == "node's GPUs of class h100 have 24 GB each, needs 40 GB per GPU" + NEVER
    # Some big enough, but fewer than wanted: the count of those is what can never grow.
    mixed = node("mixed", gpus=2, mem=80)
    assert mixed.report is not None
    small = replace(mixed, report=replace(mixed.report, gpus=(Gpu(0, "h100", 80), Gpu(1, "h100", 24))))
    two = model("m", profile(gpus=2, gpu_class=("h100",), gpu_memory_gb=40))
    assert reason(two, small) == (  # nodes.yaml cannot declare two sizes: it says so as well
        "node has 1 GPU of class h100 with 40 GB in all, needs 2 (nodes.yaml declares 2 × h100 80 GB, the agent "
        "reports 1 × h100 24 GB, 1 × h100 80 GB: placement counts the agent's)" + NEVER)


def test_a_busy_or_sick_node_keeps_the_transient_reason() -> None:
    m = model("m", profile(gpus=1, gpu_class=("sim",)))
    busy = reason(m, node("n", gpus=2, cls="sim", mem=24), [on("n", 0, 1)])
    assert busy == "needs 1 free GPU of class sim, has 0 (of 2: 2 in use)"
    assert "never" not in busy
    sick = reason(model("m", profile(gpus=4)), node("s", gpus=4, unhealthy={1: "ecc errors: 3"}))
    assert sick == "needs 4 free GPUs, has 3 (of 4: 1 unhealthy (gpu1: ecc errors: 3))"


def test_a_gpu_reason_names_a_declaration_the_agent_contradicts() -> None:
    m = model("m", profile(gpus=1, gpu_class=("l40s",)))
    n = node("gpu-1", gpus=0)
    declared = replace(n, spec=replace(n.spec, gpus=GpuSpec(2, "l40s", 48)))
    assert reason(m, declared) == (
        "node has no GPUs (nodes.yaml declares 2 × l40s 48 GB, the agent reports none: placement counts "
        "the agent's)" + NEVER)
    # A node whose declaration agrees reads as before.
    agreed = node("gpu-2", gpus=2, cls="sim", mem=24)
    agreed = replace(agreed, spec=replace(agreed.spec, gpus=GpuSpec(2, "sim", 24)))
    assert reason(m, agreed) == "node has no GPU of class l40s (it has 2 × sim)" + NEVER
    # One that disagrees on the class: both the reason and the disagreement, in one parenthesis.
    other = replace(agreed, spec=replace(agreed.spec, gpus=GpuSpec(2, "l40s", 48)))
    assert reason(m, other) == (
        "node has no GPU of class l40s (it has 2 × sim; nodes.yaml declares 2 × l40s 48 GB, the agent reports "
        "2 × sim 24 GB: placement counts the agent's)" + NEVER)


def test_placement_goes_by_what_the_agent_reports_not_by_nodes_yaml() -> None:
    """The agent's report is what the node has: a declaration of more places nothing on it."""
    n = node("gpu-1", gpus=0)
    declared = replace(n, spec=replace(n.spec, gpus=GpuSpec(2, "l40s", 48)))
    result = place(catalog(model("m", profile(gpus=1))), inventory(declared), [], now=0)
    assert result.placements == () and result.unplaced == {"m": 1}


def test_a_spec_without_gpus_still_places_on_the_gpus_the_agent_reports() -> None:
    n = node("gpu-1", gpus=2, cls="sim", mem=24)
    n = replace(n, spec=NodeSpec(n.spec.id, n.spec.address))  # nodes.yaml declares none
    result = place(catalog(model("m", profile(gpus=1))), inventory(n), [], now=0)
    assert [p.shards for p in result.placements] == [(Shard("gpu-1", 0, (0,)),)]


def test_ram_or_local_disk_smaller_than_asked_in_all_never_fits() -> None:
    m = model("m", profile(gpus=0, memory_gb=64, engine="llama.cpp"), size_gb=1)
    assert reason(m, node("small", gpus=0, ram_gb=32)) == "node has 32 GB RAM in all, needs 64" + NEVER
    # Enough RAM in all, taken by others: waiting helps.
    busy = Placement("busy", "cpu", (Shard(NodeId("big"), 0, ()),), memory_gb=100)
    assert reason(m, node("big", gpus=0, ram_gb=128), [busy]) == "needs 64 GB RAM free, has 28"
    huge = model("huge", profile(gpus=1), size_gb=5000)  # the test node's cache filesystem holds 4000 GB
    assert reason(huge, node("n", gpus=1)) == (
        "node's local disk for the weights holds 4000 GB in all, needs 5000" + NEVER)
    assert reason(model("m", profile(gpus=1), size_gb=100), node("n", gpus=1, disk_gb=50)) == (
        "needs 100 GB free local disk for the weights, has 50")
