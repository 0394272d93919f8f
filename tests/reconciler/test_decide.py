"""decide(): the reconciler's choices from desired, actual, usage and time, without I/O."""

from __future__ import annotations

from dataclasses import replace

from llmgw.catalog import Catalog, Scaling
from llmgw.contract import Demand
from llmgw.decide.replica import Replica, ReplicaState, fingerprint
from llmgw.decide.tick import decide
from llmgw.inventory import Inventory, NodeState
from llmgw.placement import Placement, Shard
from tests.placement.fleet import inventory, model, node, profile

M = model("m", profile(gpus=1))


def scaled(m, **kw):
    return replace(m, scaling=Scaling(**{"min": 1, "max": 3, "idle_after": None, "target_inflight": 4, **kw}))


def replica(rid: str, m=M, *, node_id: str = "a", gpu: int = 0, state=ReplicaState.READY, ready_since=0.0,
            **kw) -> Replica:
    p = m.profiles[0]
    return Replica(
        id=rid, model=m.name, profile=p.name,
        placement=Placement(m.name, p.name, (Shard(node_id, 0, (gpu,)),), weights=m.cache_name, size_gb=m.size_gb),
        generation=int(rid.rsplit("g", 1)[-1]) if "g" in rid else 1, fingerprint=fingerprint(m, p), state=state,
        created_at=0.0, state_since=0.0, ready_since=ready_since, **kw,
    )


def run(cat: Catalog, inv: Inventory, replicas, *, now=100.0, last_used=None, demand=None):
    return decide(cat, inv, replicas, last_used=last_used or {}, demand=demand or {}, now=now, with_reasons=True)


def test_places_up_to_min() -> None:
    d = run(Catalog(models=(scaled(M, min=2),)), inventory(node("a")), [])
    assert [p.placement.shards for p in d.create] == [(Shard("a", 0, (0,)),), (Shard("a", 0, (1,)),)]
    assert d.stop == ()


def test_model_that_left_the_catalog_is_stopped() -> None:
    d = run(Catalog(models=()), inventory(node("a")), [replica("m-g1")])
    assert d.stop == (("m-g1", "model left the catalog"),)


def test_idle_replicas_above_min_stop_longest_idle_first() -> None:
    m = scaled(M, min=1, idle_after=60.0)
    reps = [replica("m-g1"), replica("m-g2", gpu=1), replica("m-g3", gpu=2)]
    d = run(Catalog(models=(m,)), inventory(node("a")), reps, now=1000.0,
            last_used={"m-g1": 990.0, "m-g2": 100.0, "m-g3": 500.0})
    assert [rid for rid, _ in d.stop] == ["m-g2", "m-g3"]
    assert d.stop[0][1] == "idle for 900s (idle_after 60s)"
    assert d.create == ()


def test_held_request_wakes_a_model_scaled_to_zero_and_blocks_idle_stop() -> None:
    m = scaled(M, min=0, idle_after=60.0)
    d = run(Catalog(models=(m,)), inventory(node("a")), [], demand={"m": Demand(held=2)})
    assert len(d.create) == 1 and d.create[0].reason == "woken by 2 held request(s)"
    d = run(Catalog(models=(m,)), inventory(node("a")), [replica("m-g1")], now=1000.0,
            demand={"m": Demand(held=1)})
    assert d.stop == ()


def test_no_idle_stop_while_the_load_needs_every_replica() -> None:
    m = scaled(M, min=1, idle_after=60.0, target_inflight=4)
    reps = [replica("m-g1"), replica("m-g2", gpu=1)]
    d = run(Catalog(models=(m,)), inventory(node("a")), reps, now=1000.0, demand={"m": Demand(inflight=6)})
    assert d.stop == ()
    d = run(Catalog(models=(m,)), inventory(node("a")), reps, now=1000.0, demand={"m": Demand(inflight=3)})
    assert [rid for rid, _ in d.stop] == ["m-g1"]


def test_inflight_above_target_adds_one_replica() -> None:
    m = scaled(M, target_inflight=4)
    d = run(Catalog(models=(m,)), inventory(node("a")), [replica("m-g1")], demand={"m": Demand(inflight=9)})
    assert len(d.create) == 1 and d.create[0].reason == "9 requests in flight"
    d = run(Catalog(models=(m,)), inventory(node("a")), [replica("m-g1")], demand={"m": Demand(inflight=4)})
    assert d.create == ()


def test_draining_node_gets_a_replacement_first_then_the_old_stops() -> None:
    inv = inventory(node("a", state=NodeState.DRAINING), node("b"))
    old = replica("m-g1", node_id="a")
    d = run(Catalog(models=(M,)), inv, [old])
    assert d.stop == ()
    assert [(c.replaces, c.placement.shards[0].node) for c in d.create] == [("m-g1", "b")]
    new = replica("m-g2", node_id="b", state=ReplicaState.STARTING, replaces="m-g1")
    d = run(Catalog(models=(M,)), inv, [old, new])
    assert d.stop == () and d.create == ()  # min stays met by the old one meanwhile
    d = run(Catalog(models=(M,)), inv, [old, replace(new, state=ReplicaState.READY)])
    assert d.stop == (("m-g1", "replaced by m-g2 (its node is draining)"),)
    assert d.create == ()  # the replacement takes the old one's slot: nothing more to start


def test_changed_profile_is_replaced() -> None:
    old = replica("m-g1")
    changed = replace(M, profiles=(replace(M.profiles[0], args=("--max-model-len", "4096")),))
    d = run(Catalog(models=(changed,)), inventory(node("a")), [old])
    assert [(c.replaces, c.reason) for c in d.create] == [("m-g1", "replaces m-g1: its profile changed")]


def test_node_lost_past_grace_is_replaced_elsewhere() -> None:
    a = replace(node("a"), state=NodeState.UNREACHABLE, unreachable_since=50.0)
    inv = inventory(a, node("b"))
    d = run(Catalog(models=(M,)), inv, [replica("m-g1", node_id="a")], now=60.0)
    assert d.lost == () and d.create == ()  # within the grace: wait
    d = run(Catalog(models=(M,)), inv, [replica("m-g1", node_id="a")], now=90.0)
    assert d.lost == (("m-g1", "node a unreachable past the grace period"),)
    assert [c.placement.shards[0].node for c in d.create] == ["b"]


def test_above_max_stops_not_ready_first() -> None:
    m = scaled(M, min=1, max=1)
    d = run(Catalog(models=(m,)), inventory(node("a")),
            [replica("m-g1"), replica("m-g2", gpu=1, state=ReplicaState.STARTING)])
    assert d.stop == (("m-g2", "above max (1)"),)


def test_unplaceable_model_is_reported_with_reasons() -> None:
    big = model("big", profile(gpus=16))
    d = run(Catalog(models=(big,)), inventory(node("a")), [])
    assert d.unplaced == {"big": 1}
    assert [str(r) for r in d.rejections] == ["big/gpu on a: node has 8 GPUs in all, needs 16: never fits on this node"]


def test_scaling_for_load_acts_on_what_the_engines_count_not_on_what_a_router_says() -> None:
    """A router's report of 50 in flight against an engine that counts 1 running and 1 waiting:
    the model scales as for 2, and the other 48 are said to be unconfirmed."""
    from llmgw.decide.demand import believed_demand

    cat = Catalog(models=(scaled(M, min=1, max=3, target_inflight=1),))
    reps = [replica("r1-g1"), replica("r2-g1", gpu=1, state=ReplicaState.STARTING)]
    said = {M.name: Demand(held=0, inflight=50)}
    believed = believed_demand(said, {"r1-g1": (1, 1)}, reps)
    assert believed.demand[M.name] == Demand(held=0, inflight=2) and believed.unconfirmed == {M.name: 48}
    # One ready replica not read among others that are: it counts none.
    reps3 = [replica("r1-g1"), replica("r2-g1", gpu=1)]
    assert believed_demand(said, {"r1-g1": (3, 0)}, reps3).demand[M.name].inflight == 3
    # A source that reads no engine: the routers' word stands.
    assert believed_demand(said, None, reps).demand == said and believed_demand(said, None, reps).unconfirmed == {}
    # One that reads them, every reading failed at once (all timed out on a loaded machine): none
    # of it is confirmed (CI saw a forged report scale a model up through such a moment).
    assert believed_demand(said, {}, reps).demand[M.name].inflight == 0
    assert believed_demand(said, {}, reps).unconfirmed == {M.name: 50}
    # Held requests with nothing ready: believed (no engine to ask); they take a model to one.
    held = {M.name: Demand(held=9, inflight=0)}
    assert believed_demand(held, {"x": (0, 0)}, []).demand == held
    # What decide makes of it: 50 said would add a replica; the 2 counted on one ready replica too,
    # and 1 counted on it would not.
    one = [replica("r1-g1")]
    inv = inventory(node("a"))
    assert run(cat, inv, one, demand=believed_demand(said, {"r1-g1": (1, 1)}, one).demand).create
    assert not run(cat, inv, one, demand=believed_demand(said, {"r1-g1": (1, 0)}, one).demand).create
