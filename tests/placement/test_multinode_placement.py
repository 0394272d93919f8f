"""A replica across nodes: only a llama.cpp head needs the weights (disk, fetch); its workers need
memory. vLLM and SGLang load the weights on every rank, so every node needs the room."""

from __future__ import annotations

from llmgw.placement import Shard, explain, place
from llmgw.placement.capacity import free_capacity
from tests.placement.fleet import catalog, inventory, model, node, profile


def split(engine: str = "llama.cpp"):  # noqa: ANN201
    return profile("split", gpus=0, nodes=3, fabric="lan", memory_gb=4, engine=engine)


def lan(node_id: str, **kw):  # noqa: ANN201
    return node(node_id, gpus=0, fabric="lan", ram_gb=16, **kw)


def test_llamacpp_head_lands_where_the_weights_fit_and_workers_need_no_disk() -> None:
    m = model("smol", split(), size_gb=50)
    inv = inventory(lan("a", disk_gb=1), lan("b", disk_gb=1), lan("c", disk_gb=100))
    [p] = place(catalog(m), inv, [], now=0).placements
    assert p.shards == (Shard("c", 0, (), holds_weights=True), Shard("a", 1, (), holds_weights=False),
                        Shard("b", 2, (), holds_weights=False))
    # The weights take room on the head's node only; every node gives its RAM.
    free = free_capacity(inv, [p])
    assert [round(free[n].disk_gb) for n in "abc"] == [1, 1, 50]
    assert [free[n].ram_gb for n in "abc"] == [12, 12, 12]


def test_vllm_across_nodes_needs_the_weights_room_on_every_node() -> None:
    m = model("smol", split("vllm"), size_gb=50)
    result = place(catalog(m), inventory(lan("a", disk_gb=1), lan("b", disk_gb=1), lan("c", disk_gb=100)), [], now=0)
    assert result.unplaced == {"smol": 1}
    assert {r.node for r in result.rejections} == {"a", "b"}


def test_a_node_already_holding_the_weights_is_the_head() -> None:
    m = model("smol", split(), size_gb=50)
    source = m.source
    inv = inventory(lan("a", disk_gb=100), lan("b", disk_gb=100), lan("c", disk_gb=0, held=(source,)))
    [p] = place(catalog(m), inv, [], now=0).placements
    assert p.shards[0] == Shard("c", 0, (), holds_weights=True)


def test_workers_still_need_memory() -> None:
    m = model("smol", split(), size_gb=1)
    result = place(catalog(m), inventory(lan("a"), lan("b"), node("c", gpus=0, fabric="lan", ram_gb=2)), [], now=0)
    assert result.unplaced == {"smol": 1}
    assert [r.reason for r in result.rejections if r.node == "c"] == [
        "node has 2 GB RAM in all, needs 4: never fits on this node"]


def test_explain_shows_each_shard_by_rank_with_what_its_node_holds() -> None:
    m = model("smol", split(), size_gb=50)
    inv = inventory(lan("a", disk_gb=1), lan("b", disk_gb=1), lan("c", disk_gb=100))
    [p] = place(catalog(m), inv, [], now=0).placements
    lines = explain(catalog(m), inv, [p], "smol").lines()
    assert lines[:5] == [
        "model smol: 1 replica(s) placed",
        "  running: profile split on c gpus [], a gpus [], b gpus []",
        "    rank 0 (head) on c: no GPU, 4 GB RAM, the weights of smol (50 GB)",
        "    rank 1 (worker) on a: no GPU, 4 GB RAM, no weights (the head sends its layers)",
        "    rank 2 (worker) on b: no GPU, 4 GB RAM, no weights (the head sends its layers)",
    ]
    # With the replica gone, each node is judged as a head and as a worker.
    idle = explain(catalog(m), inv, [], "smol").lines()
    assert "  split on a: as head rejected: needs 50 GB free local disk for the weights, has 1; as worker fits" \
        in idle
    assert "  split on c: as head fits; as worker fits" in idle


def test_a_model_across_more_nodes_than_can_take_a_shard_is_unrunnable_and_says_why() -> None:
    from llmgw.placement import unrunnable

    m = model("smol", split(), size_gb=1)
    # Two fabric nodes that each fit, and one off the fabric: no replica of three can come.
    inv = inventory(lan("a"), lan("b"), node("c", gpus=0, ram_gb=16))
    assert unrunnable(catalog(m), inv, ["smol"]) == {
        "smol": "no node can run it: split spans 3 nodes, only 2 could take a shard | "
                "split on c: fabric lan wanted, node has none"}
    assert unrunnable(catalog(m), inventory(lan("a"), lan("b"), lan("c", disk_gb=0)), ["smol"]) == {}
