"""A replica across nodes through its lifecycle, one step at a time, against the recording
dispatcher: weights fetched on the head only, workers first, the head once every worker answers,
and any shard failing stops every shard (head first) and restarts the replica as a whole."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import aiohttp

from llmgw.catalog import Catalog, Model, ModelName, NodeId, NodeSpec, Profile, Scaling
from llmgw.decide.replica import Replica, ReplicaState, ShardStatus, fingerprint, shard_agent_id
from llmgw.dispatch.recording import RecordingDispatcher
from llmgw.inventory import Inventory, Node, NodeReport, NodeState, parse_engine
from llmgw.placement import Placement, Shard
from llmgw.reconciler.config import ReconcilerConfig
from llmgw.reconciler.lifecycle import Lifecycle
from llmgw.state import Store

NODES = ("n1", "n2", "n3")
PROFILE = Profile(name="split", priority=0, engine="llama.cpp", gpus=0, nodes=3, memory_gb=1, fabric="lan",
                  args=("--threads", "1"))
MODEL = Model(name=ModelName("smol"), source="file:///srv/models/smol.gguf", size_gb=0.2, profiles=(PROFILE,),
              scaling=Scaling(min=1, max=1))


def fleet() -> RecordingDispatcher:
    d = RecordingDispatcher()
    for i, n in enumerate(NODES, start=1):
        d.add_node(n, engine_names=("llama.cpp", "rpc-server"), advertise_address=f"127.0.0.{i}")
    return d


def inventory(d: RecordingDispatcher, *, listening: set[str], dead: set[str] = frozenset(), now: float) -> Inventory:
    """What the agents report: their engines, an rpc-server listening when the test says so."""
    nodes = {}
    for i, n in enumerate(NODES, start=1):
        engines = tuple(
            parse_engine({**d._engine_view(e), "alive": e["replica_id"] not in dead,
                          "listening": e["replica_id"] in listening})
            for e in d.nodes[n].engines.values())
        report = NodeReport(hostname=n, agent_version="fake", engines=engines, fabric_address=f"127.0.0.{i}")
        nodes[n] = Node(NodeSpec(NodeId(n), f"10.1.0.{i}", fabric="lan"), NodeState.READY, report, last_seen=now)
    return Inventory(nodes, taken_at=now)


def replica() -> Replica:
    rid = "smol-g7"
    placement = Placement(ModelName("smol"), "split",
                          tuple(Shard(NodeId(n), r, (), holds_weights=r == 0) for r, n in enumerate(NODES)),
                          memory_gb=1, size_gb=0.2, weights=MODEL.cache_name)
    shards = tuple(ShardStatus(NodeId(n), r, (), shard_agent_id(rid, r)) for r, n in enumerate(NODES))
    return Replica(id=rid, model=ModelName("smol"), profile="split", placement=placement, generation=7,
                   fingerprint=fingerprint(MODEL, PROFILE), shards=shards)


def test_workers_first_head_once_they_answer_and_a_failed_shard_restarts_the_whole_replica(tmp_path: Path) -> None:
    async def main() -> None:
        d = fleet()
        store = Store(tmp_path / "llmgw.db").open()
        clock = [1000.0]
        catalog = Catalog(models=(MODEL,))
        async with aiohttp.ClientSession() as session:
            life = Lifecycle(d, session, store, ReconcilerConfig(backoff_base=5), lambda: clock[0])
            r = replica()

            # Weights fetched on the head's node only; the two workers started, the head not yet.
            r = await life.advance(r, catalog, inventory(d, listening=set(), now=clock[0]))
            assert [c.node_id for c in d.calls_of("fetch")] == ["n1"]
            r = await life.advance(r, catalog, inventory(d, listening=set(), now=clock[0]))
            starts = d.calls_of("start")
            assert [(c.node_id, c.request["engine"], c.request["weights"]) for c in starts] == [
                ("n2", "rpc-server", None), ("n3", "rpc-server", None)]
            assert starts[0].request["args"] == ["--host", "{host}", "--port", "{port}", "--threads", "1"]
            assert r.state == ReplicaState.STARTING and r.shards[0].pid is None

            # One worker listening is not every worker: the head waits, and says for whom.
            listening = {shard_agent_id(r.id, 1)}
            r = await life.advance(r, catalog, inventory(d, listening=listening, now=clock[0]))
            assert len(d.calls_of("start")) == 2 and r.error == "waiting for workers: n3 (rank 2)"

            listening.add(shard_agent_id(r.id, 2))
            r = await life.advance(r, catalog, inventory(d, listening=listening, now=clock[0]))
            head = d.calls_of("start")[-1]
            assert head.node_id == "n1" and head.request["engine"] == "llama.cpp"
            assert head.request["weights"] == MODEL.weights_ref
            workers = [f"127.0.0.{i}:{s.port}" for i, s in ((2, r.shards[1]), (3, r.shards[2]))]
            args = head.request["args"]
            assert args[args.index("--rpc") + 1] == ",".join(workers)
            assert args[args.index("--n-gpu-layers") + 1] == "999"
            assert r.shards[0].pid is not None and r.state == ReplicaState.STARTING

            # A worker dies: the replica fails, and every shard is stopped at once, head first.
            r = replace(r, state=ReplicaState.READY, ready_since=clock[0])
            clock[0] += 1
            dead = {shard_agent_id(r.id, 2)}
            r = life.observe(r, inventory(d, listening=listening, dead=dead, now=clock[0]), clock[0])
            assert r.state == ReplicaState.FAILED and "n3 exited" in (r.error or ""), r.error
            r = await life.advance(r, catalog, inventory(d, listening=listening, dead=dead, now=clock[0]))
            assert [c.node_id for c in d.calls_of("stop")] == ["n1", "n2", "n3"]
            assert all(s.pid is None for s in r.shards) and r.state == ReplicaState.FAILED
            assert not any(e for n in NODES for e in d.nodes[n].engines)
            assert any(e.kind == "replica-shards-stopped" for e in store.events())

            # After the backoff the replica starts again as a whole: workers first again.
            clock[0] += 10
            r = await life.advance(r, catalog, inventory(d, listening=set(), now=clock[0]))
            assert r.state == ReplicaState.PENDING
            before = len(d.calls_of("start"))
            r = await life.advance(r, catalog, inventory(d, listening=set(), now=clock[0]))
            assert [c.node_id for c in d.calls_of("start")[before:]] == ["n2", "n3"]
        store.close()

    asyncio.run(main())


def test_vllm_ranks_meet_at_the_heads_fabric_address_workers_first_with_the_fabric_env(tmp_path: Path) -> None:
    profile = Profile(name="pp", priority=0, engine="vllm", gpus=1, nodes=2, fabric="lan")
    model = Model(name=ModelName("big"), source="hf://org/big", size_gb=10, profiles=(profile,))
    rid = "big-g3"
    placement = Placement(ModelName("big"), "pp", (Shard(NodeId("n1"), 0, (0,)), Shard(NodeId("n2"), 1, (0,))),
                          size_gb=10, weights=model.cache_name)
    r = Replica(id=rid, model=ModelName("big"), profile="pp", placement=placement, generation=3,
                fingerprint=fingerprint(model, profile),
                shards=tuple(ShardStatus(NodeId(n), i, (0,), shard_agent_id(rid, i))
                             for i, n in enumerate(("n1", "n2"))))

    async def main() -> None:
        d = RecordingDispatcher()
        for i, n in enumerate(("n1", "n2", "n3"), start=1):
            d.add_node(n, engine_names=("vllm",), advertise_address=f"127.0.0.{i}")
        store = Store(tmp_path / "llmgw.db").open()
        catalog = Catalog(models=(model,))
        async with aiohttp.ClientSession() as session:
            life = Lifecycle(d, session, store, ReconcilerConfig(), lambda: 5.0)
            state = await life.advance(r, catalog, inventory(d, listening=set(), now=5.0))
            # Every rank loads the weights: fetched on both nodes.
            assert sorted(c.node_id for c in d.calls_of("fetch")) == ["n1", "n2"]
            [worker] = d.calls_of("start")
            assert worker.node_id == "n2" and worker.request["weights"] == model.weights_ref
            args = worker.request["args"]
            # The head's address is its agent's fabric_address, known before the head runs.
            assert args[args.index("--master-addr") + 1] == "127.0.0.1" and "--headless" in args
            assert worker.request["env"] == {"VLLM_HOST_IP": "{fabric_address}",
                                             "NCCL_SOCKET_IFNAME": "={fabric_interface}",
                                             "GLOO_SOCKET_IFNAME": "{fabric_interface}"}
            # A vLLM worker answers by running (it has no port of its own to listen on).
            state = await life.advance(state, catalog, inventory(d, listening=set(), now=5.0))
            head = d.calls_of("start")[-1]
            assert head.node_id == "n1" and "--headless" not in head.request["args"]
            assert state.shards[0].pid is not None
        store.close()

    asyncio.run(main())
