"""A drain that cannot finish says why and does not call the replica that serves "unplaced"; with
room elsewhere a replica across nodes moves (seen: a drain of a node holding one shard of a
two-node replica never finished, said nothing, and `llmgw status` called the replica unplaced)."""

from __future__ import annotations

from dataclasses import replace

from llmgw.catalog import Catalog, Model, ModelName, NodeId, Scaling
from llmgw.decide.replica import Replica, ReplicaState, ShardStatus, fingerprint, shard_agent_id
from llmgw.decide.tick import decide
from llmgw.inventory import NodeState
from llmgw.placement import Placement, Shard
from tests.placement.fleet import inventory, node, profile

SPLIT = profile("split", gpus=1, nodes=2, fabric="lan", engine="llama.cpp")
MODEL = Model(name=ModelName("big"), source="hf://org/big", size_gb=10, profiles=(SPLIT,), scaling=Scaling(1, 1))


def lan(node_id: str, *, draining: bool = False, gpus: int = 1):  # noqa: ANN201
    n = node(node_id, gpus=gpus, fabric="lan", held=("hf://org/big",))
    return replace(n, state=NodeState.DRAINING) if draining else n


def running(nodes: tuple[str, str]) -> Replica:
    rid = "big-g1"
    placement = Placement(ModelName("big"), "split", tuple(Shard(NodeId(n), i, (0,), holds_weights=i == 0)
                                                           for i, n in enumerate(nodes)),
                          size_gb=10, weights=MODEL.cache_name)
    return Replica(id=rid, model=ModelName("big"), profile="split", placement=placement, generation=1,
                   fingerprint=fingerprint(MODEL, SPLIT), state=ReplicaState.READY, ready_since=0.0,
                   shards=tuple(ShardStatus(NodeId(n), i, (0,), shard_agent_id(rid, i), pid=100 + i)
                                for i, n in enumerate(nodes)), created_at=0.0, state_since=0.0)


def test_a_drain_with_no_room_elsewhere_says_so_and_the_serving_replica_is_not_unplaced() -> None:
    inv = inventory(lan("a", draining=True), lan("b"))
    d = decide(Catalog(models=(MODEL,)), inv, [running(("a", "b"))], last_used={}, demand={}, now=10.0)
    assert d.create == () and d.stop == ()
    assert d.unplaced == {}
    assert "no room for its replacement (big/split) off a: it serves on" in d.drain_waits["big-g1"]


def test_a_replica_across_nodes_moves_off_a_draining_node_when_there_is_room() -> None:
    # Room beside it (b has a second GPU): the new replica starts on b and c first.
    inv = inventory(lan("a", draining=True), lan("b", gpus=2), lan("c"))
    d = decide(Catalog(models=(MODEL,)), inv, [running(("a", "b"))], last_used={}, demand={}, now=10.0)
    [new] = d.create
    assert new.replaces == "big-g1" and {s.node for s in new.placement.shards} == {"b", "c"}
    assert d.drain_waits == {} and d.stop == ()
    # Room only in its place (b's one GPU is its own): stopped first (max_unavailable), then placed on
    # b and c; the drain does not wait.
    inv = inventory(lan("a", draining=True), lan("b"), lan("c"))
    d = decide(Catalog(models=(MODEL,)), inv, [running(("a", "b"))], last_used={}, demand={}, now=10.0)
    assert [rid for rid, _ in d.stop] == ["big-g1"] and d.drain_waits == {} and d.unplaced == {}
