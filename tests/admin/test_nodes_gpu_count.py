"""`llmgw nodes` counts a GPU as free exactly when placement would use it: GPUs held by engines
no replica of ours claims (another controller's, a stale one not yet stopped) and by replicas
still stopping are taken (seen: `llmgw nodes` said 2/2 free where placement put nothing)."""

from __future__ import annotations

from dataclasses import replace

from llmgw.admin.views import node_view, nodes_view
from llmgw.catalog import Catalog
from llmgw.decide import ReplicaState
from llmgw.inventory import EngineRecord, Inventory
from tests.placement.fleet import inventory, node
from tests.reconciler.test_decide import M, replica, run, scaled


def _with_engines(inv: Inventory, node_id: str, *engines: EngineRecord) -> Inventory:
    n = inv.nodes[node_id]
    assert n.report is not None
    return Inventory({**inv.nodes, node_id: replace(n, report=replace(n.report, engines=engines))})


def foreign(rid: str, gpus: tuple[int, ...], *, alive: bool = True) -> EngineRecord:
    return EngineRecord(rid, pid=4242, port=8000, endpoint=None, engine="sim", alive=alive, gpus=gpus,
                        labels=(("llmgw.replica", rid),), holder="ctl-other", epoch=1)


def test_gpus_of_another_controllers_engines_are_not_free_in_nodes_or_placement() -> None:
    inv = _with_engines(inventory(node("a", gpus=2)), "a", foreign("other-g1.r0", (1,)),
                        foreign("gone-g2.r0", (0,), alive=False))
    ours = [replica("m-g1", gpu=0)]
    (view,) = nodes_view(inv, ours, now=0.0)
    assert (view["gpu_total"], view["gpu_free"]) == (2, 0)
    # Placement agrees: a second replica of m has no GPU on a.
    d = run(Catalog(models=(scaled(M, min=2),)), inv, ours)
    assert d.create == () and d.unplaced == {"m": 1}
    # One node alone (the admin API's /nodes/{id}) counts the same way.
    assert node_view(inv.nodes["a"], ours, 0.0)["gpu_free"] == 0


def test_a_stopping_replica_holds_its_gpu_and_a_stopped_one_does_not() -> None:
    inv = inventory(node("a", gpus=2))
    stopping = [replica("m-g1", gpu=0, state=ReplicaState.STOPPING)]
    assert nodes_view(inv, stopping, now=0.0)[0]["gpu_free"] == 1
    stopped = [replica("m-g1", gpu=0, state=ReplicaState.STOPPED)]
    assert nodes_view(inv, stopped, now=0.0)[0]["gpu_free"] == 2


