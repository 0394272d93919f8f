"""adopt(): which engines no record claims a controller takes over, and which it stops, without I/O.

Every reason to adopt, stop or wait has its case here; the reconciler applying it is tested in
test_adoption_reconciler.py, and a controller process on real nodes in tests/e2e/test_adoption.py."""

from __future__ import annotations

from dataclasses import replace

from llmgw.catalog import Catalog, Model, NodeId, Scaling
from llmgw.decide.adopt import adopt
from llmgw.decide.replica import Replica, ReplicaState, ShardStatus, fingerprint
from llmgw.decide.tick import CanaryWant, decide
from llmgw.inventory import EngineRecord, Inventory, Lease, Node, NodeState
from llmgw.inventory.model import EngineLabels, engine_labels, missing_labels
from llmgw.placement import Placement, Shard
from tests.placement.fleet import model, node, profile

NOW = 1000.0
CHAT = replace(model("chat", profile("gpu", gpus=1)), scaling=Scaling(min=1, max=2))
SPLIT = replace(model("split", profile("dist", gpus=1, nodes=2)), scaling=Scaling(min=1, max=1))
CATALOG = Catalog(models=(CHAT, SPLIT))
MINE = "ctl-mine"
OLD = "ctl-old"  # the controller that started the engines (its lease lapsed)


def engine(rid: str, m: Model = CHAT, *, rank: int = 0, gpus: tuple[int, ...] = (0,), generation: int | None = None,
           fp: str | None = None, canary: bool = False, holder: str | None = OLD, alive: bool = True,
           pid: int = 4242, labels: dict[str, str] | None = None, kind: str | None = None,
           endpoint: str | None = "http://10.0.0.1:8100") -> EngineRecord:
    """An engine as an agent reports it, labelled as the reconciler starts it."""
    p = m.profiles[0]
    made = EngineLabels(replica=rid, model=m.name, profile=p.name, rank=rank, shards=p.nodes,
                        generation=generation if generation is not None else int(rid.rsplit("-g", 1)[1]),
                        fingerprint=fp or fingerprint(m, p), canary=canary, revision="abc123").to_labels()
    return EngineRecord(replica_id=f"{rid}.r{rank}", pid=pid, port=8100, endpoint=endpoint if rank == 0 else None,
                        engine=kind or p.engine, alive=alive, exit_code=None if alive else 1,
                        labels=tuple(sorted((labels if labels is not None else made).items())),
                        started_at=500.0, gpus=gpus, holder=holder, epoch=1)


def held(node_id: str, *engines: EngineRecord, state: NodeState = NodeState.READY, lease: bool = True,
         **kw) -> Node:
    """A node whose lease this controller holds (``lease``), running ``engines``."""
    n = node(node_id, gpus=2, **kw)
    assert n.report is not None
    report = replace(n.report, engines=engines, lease=Lease(MINE if lease else OLD, 2, NOW + 60, held=lease))
    return replace(n, report=report, state=state)


def inv(*nodes: Node) -> Inventory:
    return Inventory({n.id: n for n in nodes}, NOW)


def run(inventory: Inventory, replicas: list[Replica] | None = None, catalog: Catalog = CATALOG, **kw):  # noqa: ANN201
    return adopt(catalog, inventory, replicas or [], now=NOW, holder=MINE, **kw)


def record(rid: str, node_id: str = "a", gpu: int = 0, m: Model = CHAT, **kw) -> Replica:
    p = m.profiles[0]
    return Replica(id=rid, model=m.name, profile=p.name,
                   placement=Placement(m.name, p.name, (Shard(NodeId(node_id), 0, (gpu,)),)),
                   generation=int(rid.rsplit("-g", 1)[1]), fingerprint=fingerprint(m, p),
                   state=ReplicaState.READY, shards=(), **kw)


def reasons(result) -> dict[str, str]:  # noqa: ANN001
    return {s.agent_id: s.reason for s in result.stop}


# --- adopted ------------------------------------------------------------------------------------

def test_an_engine_the_catalog_asks_for_is_adopted_as_it_runs() -> None:
    result = run(inv(held("a", engine("chat-g7", gpus=(1,), pid=777))))
    (r,) = result.adopt
    assert (r.id, r.model, r.profile, r.generation, r.state, r.adopted) == \
        ("chat-g7", "chat", "gpu", 7, ReplicaState.STARTING, True)
    assert r.fingerprint == fingerprint(CHAT, CHAT.profiles[0]) and r.revision == "abc123" and not r.canary
    (s,) = r.shards
    assert (s.node, s.rank, s.gpus, s.agent_id, s.pid, s.endpoint, s.state) == \
        ("a", 0, (1,), "chat-g7.r0", 777, "http://10.0.0.1:8100", "started")
    assert r.placement == Placement("chat", "gpu", (Shard(NodeId("a"), 0, (1,)),), size_gb=CHAT.size_gb,
                                    weights=CHAT.cache_name)
    assert (r.created_at, r.state_since) == (500.0, NOW)  # started then; starting (to be probed) from now
    assert result.stop == () and result.highest == 7


def test_a_replica_across_nodes_is_adopted_whole_when_every_shard_is_found() -> None:
    result = run(inv(held("a", engine("split-g3", SPLIT, rank=0)), held("b", engine("split-g3", SPLIT, rank=1))))
    (r,) = result.adopt
    assert [(s.node, s.rank, s.agent_id) for s in r.shards] == [("a", 0, "split-g3.r0"), ("b", 1, "split-g3.r1")]
    assert r.endpoint == "http://10.0.0.1:8100"


def test_this_controllers_own_engines_beyond_its_counter_are_adopted() -> None:
    """A restored older copy of the data dir: the same holder id, a counter from before the engines."""
    result = run(inv(held("a", engine("chat-g5", holder=MINE))), issued=4)
    assert [r.id for r in result.adopt] == ["chat-g5"]
    result = run(inv(held("a", engine("chat-g5", holder=None))), issued=4)  # unstamped: no lease then
    assert [r.id for r in result.adopt] == ["chat-g5"]


def test_another_controllers_generations_are_not_judged_by_this_ones_counter() -> None:
    result = run(inv(held("a", engine("chat-g2", holder=OLD))), issued=40)
    assert [r.id for r in result.adopt] == ["chat-g2"]


def test_a_canary_is_adopted_only_while_its_rollout_asks_for_one() -> None:
    new = replace(CHAT, source="hf://org/chat-v2")
    canary = engine("chat-g9", fp=fingerprint(new, new.profiles[0]), canary=True)
    result = run(inv(held("a", canary)), canaries={"chat": CanaryWant(spec=new)})
    (r,) = result.adopt
    assert r.canary and r.fingerprint == fingerprint(new, new.profiles[0])
    # Beside the model's scaling: a canary is not one of its replicas.
    full = [record("chat-g1", gpu=1), record("chat-g2", "b")]
    assert [r.id for r in run(inv(held("a", canary), held("b")), full,
                              canaries={"chat": CanaryWant(spec=new)}).adopt] == ["chat-g9"]
    # No rollout in its canary phase (it ended, or the record was lost with an empty data dir).
    assert reasons(run(inv(held("a", canary)))) == {
        "chat-g9.r0": "a canary of chat, whose rollout is not in its canary phase"}
    # One canary at a time.
    live = record("chat-g8", gpu=1, canary=True)
    assert reasons(run(inv(held("a", canary)), [live], canaries={"chat": CanaryWant(spec=new)})) == {
        "chat-g9.r0": "a canary of chat runs already"}


def test_oldest_generations_are_adopted_up_to_scaling_max() -> None:
    engines = [engine("chat-g4", gpus=(0,)), engine("chat-g2", gpus=(1,)), engine("chat-g3", gpus=(0,))]
    result = run(inv(held("a", *engines[:2]), held("b", engines[2])), [record("chat-g1", "c")])
    assert [r.id for r in result.adopt] == ["chat-g2"]
    assert reasons(result) == {"chat-g3.r0": "chat has 2 replica(s), its scaling.max (2)",
                               "chat-g4.r0": "chat has 2 replica(s), its scaling.max (2)"}
    assert result.highest == 4


def test_claimed_engines_and_engines_not_started_by_llmgw_are_not_judged() -> None:
    theirs = replace(engine("x-g1"), labels=(("app", "operator's own"),))
    claimed = replace(record("chat-g1"), shards=(ShardStatus(NodeId("a"), 0, (0,), "chat-g1.r0"),))
    result = run(inv(held("a", engine("chat-g1"), theirs)), [claimed])
    assert result.empty and result.highest == 0


# --- left alone ---------------------------------------------------------------------------------

def test_engines_on_a_node_another_controller_drives_or_hands_over_are_left_alone() -> None:
    for state in (NodeState.FENCED, NodeState.HANDOVER):
        result = run(inv(held("a", engine("chat-g3"), lease=False, state=state)))
        assert result.empty and result.highest == 3  # the counter still moves past its generation


def test_a_shard_on_a_node_that_may_yet_be_ours_waits() -> None:
    head = held("a", engine("split-g3", SPLIT, rank=0))
    for other in (held("b", engine("split-g3", SPLIT, rank=1), lease=False, state=NodeState.HANDOVER),
                  replace(held("b", engine("split-g3", SPLIT, rank=1), lease=False, state=NodeState.FENCED),
                          lapsing=True),
                  replace(held("b"), state=NodeState.UNREACHABLE, unreachable_since=NOW - 5, report=None),
                  replace(held("b"), state=NodeState.UNKNOWN, report=None)):
        result = run(inv(head, other))
        assert result.adopt == () and result.stop == ()
        ((rid, why),) = result.waiting
        assert rid == "split-g3" and "rank 1" in why and "not this controller's yet" in why


# --- stopped ------------------------------------------------------------------------------------

def test_a_stale_version_is_stopped() -> None:
    result = run(inv(held("a", engine("chat-g3", fp="0123456789abcdef"))))
    assert result.adopt == ()
    want = fingerprint(CHAT, CHAT.profiles[0])
    assert reasons(result) == {
        "chat-g3.r0": f"stale version of chat/gpu (fingerprint 0123456789abcdef; the version it serves is {want})"}


def test_a_model_or_profile_gone_from_the_catalog_is_stopped() -> None:
    result = run(inv(held("a", engine("chat-g3"))), catalog=Catalog(models=(SPLIT,)))
    assert reasons(result) == {"chat-g3.r0": "model chat left the catalog"}
    other = replace(CHAT, profiles=(profile("other", gpus=1),))
    result = run(inv(held("a", engine("chat-g3"))), catalog=Catalog(models=(other,)))
    assert reasons(result) == {"chat-g3.r0": "profile gpu of chat left the catalog"}


def test_an_engine_without_the_labels_to_rebuild_its_record_is_stopped() -> None:
    """Started by an llmgw older than adoption: its replica and generation, no fingerprint."""
    old = engine("chat-g3", labels={"llmgw.replica": "chat-g3", "llmgw.model": "chat", "llmgw.profile": "gpu",
                                    "llmgw.rank": "0", "llmgw.generation": "3", "llmgw.revision": ""})
    assert missing_labels(old) == ("llmgw.shards", "llmgw.fingerprint", "llmgw.canary") and engine_labels(old) is None
    (stop,) = run(inv(held("a", old))).stop
    assert stop.reason.startswith("labels missing (llmgw.canary, llmgw.fingerprint, llmgw.shards)")


def test_a_replica_missing_a_shard_is_stopped_whole() -> None:
    # Rank 1 reported by no node, and no node could yet become this controller's.
    result = run(inv(held("a", engine("split-g3", SPLIT, rank=0)), held("b")))
    assert reasons(result) == {"split-g3.r0": "incomplete: rank 1 runs on no node this controller holds"}
    # Rank 1 on a node another controller drives.
    result = run(inv(held("a", engine("split-g3", SPLIT, rank=0)),
                     held("b", engine("split-g3", SPLIT, rank=1), lease=False, state=NodeState.FENCED)))
    assert reasons(result) == {"split-g3.r0": "incomplete: rank 1 is on node b, which another controller drives"}
    # Rank 1 on a node unreachable past the grace.
    gone = replace(held("b"), state=NodeState.UNREACHABLE, unreachable_since=NOW - 60, report=None)
    assert reasons(run(inv(held("a", engine("split-g3", SPLIT, rank=0)), gone))) == {
        "split-g3.r0": "incomplete: rank 1 runs on no node this controller holds"}
    # Rank 1 ended: the head is stopped (an ended engine is nothing to stop).
    result = run(inv(held("a", engine("split-g3", SPLIT, rank=0)),
                     held("b", engine("split-g3", SPLIT, rank=1, alive=False))))
    assert reasons(result) == {"split-g3.r0": "rank 1 on b has ended (exit code 1)"}


def test_a_shard_unlike_its_profile_on_its_node_is_stopped() -> None:
    cases = {
        "rank 0 on a runs 'sglang', its profile 'vllm'": engine("chat-g3", kind="sglang"),
        "rank 0 on a holds GPUs [0, 1], its profile takes 1": engine("chat-g3", gpus=(0, 1)),
        "rank 0 on a holds GPUs [5] the node does not report": engine("chat-g3", gpus=(5,)),
        "its head (rank 0) reports no endpoint to serve on": engine("chat-g3", endpoint=None),
    }
    for why, e in cases.items():
        assert reasons(run(inv(held("a", e)))) == {"chat-g3.r0": why}
    classy = replace(CHAT, profiles=(profile("gpu", gpus=1, gpu_class=("a100",)),))
    e = engine("chat-g3", classy)
    assert reasons(run(inv(held("a", e)), catalog=Catalog(models=(classy,)))) == {
        "chat-g3.r0": "rank 0 on a runs on GPUs of a class its profile does not allow"}


def test_an_engine_on_a_node_whose_gpus_could_not_be_read_waits_rather_than_being_stopped() -> None:
    """nvidia-smi that timed out reads as no GPU at all: the engine was stopped as holding GPUs the
    node does not have. While the node says it could not read them, adoption waits."""
    blind = held("a", engine("chat-g3", gpus=(0,)))
    assert blind.report is not None
    blind = replace(blind, report=replace(blind.report, gpus=(), gpu_error="nvidia-smi did not answer within 15s"))
    result = run(inv(blind))
    assert result.stop == () and result.adopt == ()
    ((rid, why),) = result.waiting
    assert rid == "chat-g3" and "its GPUs could not be read (nvidia-smi did not answer within 15s)" in why


def test_gpus_another_replica_holds_are_not_adopted_twice() -> None:
    result = run(inv(held("a", engine("chat-g3", gpus=(0,)))), [record("chat-g1", "a", gpu=0)])
    assert reasons(result) == {"chat-g3.r0": "rank 0 on a holds GPUs [0] that another replica holds"}
    # Nor by two adopted replicas (another controller's engine of the same GPUs).
    result = run(inv(held("a", engine("chat-g3", gpus=(1,)), engine("chat-g4", gpus=(1,), holder="ctl-third"))))
    assert [r.id for r in result.adopt] == ["chat-g3"]
    assert reasons(result) == {"chat-g4.r0": "rank 0 on a holds GPUs [1] that another replica holds"}


def test_engines_of_replicas_this_controller_gave_up_are_stale() -> None:
    result = run(inv(held("a", engine("chat-g3"))), given_up={"chat-g3"})
    assert reasons(result) == {
        "chat-g3.r0": "replica chat-g3 was given up by this controller (stopped, or lost with its node): stale"}
    # Its own, numbered before this life began and claimed by no record: given up in an earlier life.
    result = run(inv(held("a", engine("chat-g3", holder=MINE))), issued=5)
    assert reasons(result) == {"chat-g3.r0": "generation 3 was numbered by this controller (counter 5) and its "
                                             "replica given up (stale)"}


def test_an_id_this_controller_uses_already_is_not_adopted_again() -> None:
    result = run(inv(held("a", engine("chat-g3", gpus=(1,)))), [record("chat-g3", "b")])
    assert reasons(result) == {"chat-g3.r0": "its replica id is taken by a replica of this controller that does "
                                             "not claim it"}
    # Two controllers' engines of one id: the first adopted, the second's stopped.
    result = run(inv(held("a", engine("chat-g3", gpus=(0,))), held("b", engine("chat-g3", holder="ctl-third"))))
    assert [r.id for r in result.adopt] == ["chat-g3"] and len(result.stop) == 1


def test_stops_carry_the_rank_so_heads_go_first() -> None:
    result = run(inv(held("a", engine("split-g3", SPLIT, rank=1)), held("b", engine("split-g3", SPLIT, rank=0))),
                 catalog=Catalog(models=(CHAT,)))
    assert sorted((s.rank, s.node) for s in result.stop) == [(0, "b"), (1, "a")]


# --- leases lapsing one node after another -----------------------------------------------------

def test_while_leases_lapse_node_by_node_nothing_is_placed_beside_the_engines_still_fenced() -> None:
    """A killed controller's two nodes lapse a moment apart (seen 0.15 s): in the tick between, the
    model's engine on the node still fenced is a replica coming, not a gap to fill. A new one placed
    then was adopted-over: one old engine stopped as above scaling.max, one started for nothing."""
    chat = replace(CHAT, scaling=Scaling(min=2, max=2))
    catalog = Catalog(models=(chat,))
    a = held("a", engine("chat-g1", chat))
    fenced = held("b", engine("chat-g2", chat), lease=False, state=NodeState.FENCED)
    for b, placed in ((replace(fenced, lapsing=True), 0), (fenced, 1)):  # silent holder; a live one
        (first,) = run(inv(a, b), catalog=catalog).adopt
        decided = decide(catalog, inv(a, b), [first], last_used={}, demand={}, now=NOW)
        assert len(decided.create) == placed and decided.lost == ()
    # The lease lapses: that engine is adopted in turn, nothing stopped.
    result = run(inv(a, held("b", engine("chat-g2", chat))), [first], catalog=catalog)
    assert [r.id for r in result.adopt] == ["chat-g2"] and result.stop == ()


def test_a_replica_on_a_node_whose_silent_holder_lapses_is_kept_not_lost() -> None:
    """A standby taking over from a killed leader has its records: one on a node whose lease has
    not lapsed yet is kept (not given up and replaced), one on a node a live controller took is lost."""
    mine = record("chat-g4", node_id="b")
    fenced = held("b", lease=False, state=NodeState.FENCED)
    kept = decide(CATALOG, inv(held("a"), replace(fenced, lapsing=True)), [mine], last_used={}, demand={}, now=NOW)
    assert kept.lost == () and kept.create == ()
    lost = decide(CATALOG, inv(held("a"), fenced), [mine], last_used={}, demand={}, now=NOW)
    assert [rid for rid, _ in lost.lost] == ["chat-g4"] and len(lost.create) == 1
