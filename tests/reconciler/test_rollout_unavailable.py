"""Rollouts and unavailability, as an adversarial review found them (each test failed before its fix):
a canary must not take a stable replica's place while the model is already short of replicas
(seen on real processes: two of three out at once), and a drain must move a canary off its node."""

from __future__ import annotations

from llmgw.catalog import Catalog
from llmgw.decide.replica import ReplicaState
from llmgw.decide.tick import CanaryWant, decide
from tests.placement.fleet import inventory, node
from tests.reconciler.test_decide import M, replica
from tests.reconciler.test_rollout_decide import NEW, scaled


def test_a_canary_does_not_take_a_stable_replicas_place_when_the_model_is_already_short() -> None:
    """MEDIUM. min 3, max_unavailable 1 (the default), a full 3-GPU node. One replica is missing
    (lost, crashed, or stopped first by a replacement): the tick places its successor on the last
    free GPU, finds no room for the canary, and stops one of the two serving replicas for it.
    Serving: 1 of 3, two unavailable at once where max_unavailable says 1."""
    old = scaled(M, 3)
    reps = [replica("m-g1", old, gpu=0), replica("m-g2", old, gpu=1)]
    d = decide(Catalog(models=(old,)), inventory(node("a", gpus=3)), reps, last_used={}, demand={}, now=100.0,
               canaries={"m": CanaryWant(spec=scaled(NEW, 3))})
    stopped = [rid for rid, _ in d.stop]
    serving_after = [r for r in reps if r.state == ReplicaState.READY and r.id not in stopped]
    unavailable = 3 - len(serving_after)
    assert unavailable <= old.rollout.max_unavailable, (
        f"{unavailable} of 3 unavailable: stopped {d.stop}, created {[c.reason for c in d.create]}")


def test_a_drain_moves_a_canary_off_the_draining_node() -> None:
    """MEDIUM (a drain mid-rollout). _judge_running handles a canary before the draining check
    (``if r.canary: ... continue``): a canary on a draining node is neither replaced nor stopped,
    so the node never empties while the canary phase lasts, and that phase has no end of its own
    (a step waits for traffic for ever). Expected, as for every other replica: the drain moves it
    (a new canary elsewhere, or the canary stopped and placed again)."""
    from llmgw.inventory import NodeState

    old = scaled(M, 2)
    inv = inventory(node("a", state=NodeState.DRAINING), node("b", gpus=4))
    stable = [replica("m-g1", old, node_id="b", gpu=0), replica("m-g2", old, node_id="b", gpu=1)]
    canary = replica("m-g3", scaled(NEW, 2), node_id="a", gpu=0, canary=True)
    d = decide(Catalog(models=(old,)), inv, [*stable, canary], last_used={}, demand={}, now=100.0,
               canaries={"m": CanaryWant(spec=scaled(NEW, 2))})
    moved = any(rid == "m-g3" for rid, _ in d.stop) or any(c.canary for c in d.create)
    assert moved, f"the canary stays on the draining node: stop {d.stop}, create {d.create}"
