"""`place` and `explain`: every rejection reason, and the preferences that decide a node."""

from __future__ import annotations

from llmgw.inventory import NodeState
from llmgw.placement import Shard, explain, place
from tests.placement.fleet import catalog, inventory, model, node, profile


def only_reason(result, node_id: str) -> str:
    reasons = [r.reason for r in result.rejections if r.node == node_id]
    assert len(reasons) == 1, reasons
    return reasons[0]


def test_places_on_the_fitting_node_with_the_lowest_gpus() -> None:
    cat = catalog(model("m", profile(gpus=2, gpu_class=("h100",))))
    result = place(cat, inventory(node("a100", cls="a100"), node("h100")), [], now=0)
    assert [(p.model, p.profile, p.shards) for p in result.placements] == [
        ("m", "gpu", (Shard("h100", 0, (0, 1)),))
    ]
    assert result.unplaced == {}


def test_every_rejection_reason_is_named() -> None:
    m = model("m", profile(gpus=4, gpu_class=("h100",), gpu_memory_gb=40, memory_gb=64, pool="default"),
              size_gb=100)
    inv = inventory(
        node("cordoned", state=NodeState.CORDONED),
        node("draining", state=NodeState.DRAINING),
        node("unreachable", state=NodeState.UNREACHABLE),
        node("silent", reported=False),
        node("batch", pool="batch"),
        node("a100", cls="a100"),
        node("small-gpus", mem=24),
        node("sick", gpus=4, unhealthy={1: "ecc errors: 3"}),
        node("low-ram", ram_gb=32),
        node("full-disk", disk_gb=50),
        node("nfs", disk_gb=0, shared=True),
    )
    result = place(catalog(m), inv, [], now=0)
    assert result.placements == () and result.unplaced == {"m": 1}
    assert only_reason(result, "cordoned") == "node is cordoned"
    assert only_reason(result, "draining") == "node is draining"
    assert only_reason(result, "unreachable") == "node is unreachable"
    assert only_reason(result, "silent") == "node has not reported an inventory"
    assert only_reason(result, "batch") == 'pool "default" wanted, node is in "batch"'
    assert only_reason(result, "a100") == "node has no GPU of class h100 (it has 8 × a100): never fits on this node"
    assert only_reason(result, "small-gpus") == (
        "node's GPUs of class h100 have 24 GB each, needs 40 GB per GPU: never fits on this node")
    assert only_reason(result, "sick") == (
        "needs 4 free GPUs of class h100 with 40 GB, has 3 (of 4: 1 unhealthy (gpu1: ecc errors: 3))")
    assert only_reason(result, "low-ram") == "node has 32 GB RAM in all, needs 64: never fits on this node"
    assert only_reason(result, "full-disk") == "needs 100 GB free local disk for the weights, has 50"
    assert only_reason(result, "nfs") == (
        "needs 100 GB free local disk for the weights, has 0 (its cache is on a shared filesystem, not counted)")


def test_a_node_holding_the_weights_needs_no_disk_and_is_preferred() -> None:
    m = model("m", profile(gpus=1), size_gb=500)
    inv = inventory(node("roomy", disk_gb=4000), node("holder", disk_gb=10, held=(m.source,)))
    result = place(catalog(m), inv, [], now=0)
    assert result.placements[0].shards == (Shard("holder", 0, (0,)),)


def test_existing_replicas_take_their_gpus_and_new_ones_pack_tightly() -> None:
    m = model("m", profile(gpus=2), min_=2)
    busy = place(catalog(model("other", profile(gpus=6))), inventory(node("a"), node("b")), [], now=0)
    assert busy.placements[0].shards[0].node == "a"  # tie broken by id
    # "a" has 2 GPUs left, "b" 8: the best fit for a 2-GPU replica is "a", then "b".
    result = place(catalog(m), inventory(node("a"), node("b")), busy.placements, now=0)
    assert [p.shards for p in result.placements] == [
        (Shard("a", 0, (6, 7)),),
        (Shard("b", 0, (0, 1)),),
    ]


def test_sharded_profile_needs_nodes_on_its_fabric() -> None:
    m = model("m", profile("x2", gpus=8, nodes=2, fabric="infiniband"))
    inv = inventory(node("ib-1", fabric="infiniband"), node("roce-1", fabric="roce"), node("ib-2", fabric="infiniband"))
    result = place(catalog(m), inv, [], now=0)
    assert result.placements[0].shards == (
        Shard("ib-1", 0, tuple(range(8))),
        Shard("ib-2", 1, tuple(range(8))),
    )
    # With one infiniband node gone, nothing can hold the replica, and the roce node says why.
    result = place(catalog(m), inventory(node("ib-1", fabric="infiniband"), node("roce-1", fabric="roce")), [], now=0)
    assert result.unplaced == {"m": 1}
    assert only_reason(result, "roce-1") == "fabric infiniband wanted, node has roce"


def test_profiles_are_tried_in_priority_order_falling_back_to_cpu() -> None:
    m = model("m", profile("cpu", priority=20, gpus=0, memory_gb=32, pool="batch", engine="llama.cpp"),
              profile("gpu", priority=10, gpus=1))
    gpu_taken = place(catalog(model("hog", profile(gpus=8))), inventory(node("g1")), [], now=0).placements
    inv = inventory(node("g1"), node("cpu-1", gpus=0, pool="batch", ram_gb=256))
    assert place(catalog(m), inv, [], now=0).placements[0].profile == "gpu"
    result = place(catalog(m), inv, gpu_taken, now=0)
    assert [(p.profile, p.shards) for p in result.placements] == [("cpu", (Shard("cpu-1", 0, ()),))]


def test_avoid_keeps_a_replacement_off_the_old_node() -> None:
    m = model("m", profile(gpus=1))
    result = place(catalog(m), inventory(node("a"), node("b")), [], now=0, wanted={"m": 1}, avoid={"m": ["a"]})
    assert result.placements[0].shards[0].node == "b"


def test_operator_copy_is_never_counted_against_disk() -> None:
    m = model("m", profile(gpus=1), size_gb=500, source="/models/m")
    result = place(catalog(m), inventory(node("a", disk_gb=1)), [], now=0)
    assert result.placements[0].weights is None and result.placements[0].shards[0].node == "a"


def test_explanation_text() -> None:
    m = model("m", profile(gpus=4, gpu_class=("h100",)))
    inv = inventory(node("a100", cls="a100", gpus=4), node("h100"))
    running = place(catalog(m), inv, [], now=0).placements
    assert explain(catalog(m), inv, running, "m").lines() == [
        "model m: 1 replica(s) placed",
        "  running: profile gpu on h100 gpus [0, 1, 2, 3]",
        "  gpu on a100: rejected: node has no GPU of class h100 (it has 4 × a100): never fits on this node",
        "  gpu on h100: fits",
    ]


def test_unrunnable_names_the_models_no_node_could_ever_hold() -> None:
    from llmgw.placement import unrunnable

    cat = catalog(model("huge", profile(gpus=16, gpu_class=("h100",))), model("fits", profile(gpus=2)))
    reasons = unrunnable(cat, inventory(node("h100")), ["huge", "fits"])
    assert set(reasons) == {"huge"}
    assert reasons["huge"].startswith("no node can run it: gpu on h100:") and (
        "node has 8 GPUs of class h100 in all, needs 16: never fits on this node" in reasons["huge"])
    # Before any node has reported, nothing is judged.
    assert unrunnable(cat, inventory(node("h100", reported=False)), ["huge"]) == {}
