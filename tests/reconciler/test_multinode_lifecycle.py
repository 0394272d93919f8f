"""A replica across nodes through its lifecycle, one step at a time, against the recording
dispatcher: weights fetched on the head only, workers first, the head once every worker answers,
and any shard failing stops every shard (head first) and restarts the replica as a whole."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from llmgw.catalog import Catalog, Model, ModelName, NodeId, NodeSpec, Profile, Scaling
from llmgw.decide.replica import Replica, ReplicaState, ShardStatus, fingerprint, shard_agent_id
from llmgw.dispatch.recording import RecordingDispatcher
from llmgw.gitops.desired import DesiredState
from llmgw.inventory import Inventory, Node, NodeReport, NodeState, parse_engine
from llmgw.placement import Placement, Shard
from llmgw.reconciler.config import ReconcilerConfig
from llmgw.reconciler.lifecycle import Lifecycle
from llmgw.reconciler.live import LiveInventory
from llmgw.reconciler.reconciler import Reconciler
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


# Stopping head first on the reconciler's two other paths (review of issue 27):
# Findings: a replica across nodes is not stopped head first on two paths.
#
# DESIGN §5 / issue 27: "stopping stops the head first, then the workers" (the head serves
# clients; its workers going under it fails their requests, and a llama.cpp head aborts when an
# RPC connection drops). Lifecycle._stop_shards and _stop_failed do it in rank order, but:
#
# - Reconciler.stop_all (`llmgw up` Ctrl-C: Running.close(stop_engines=True)) stops every shard of
#   every replica at once with asyncio.gather: the workers' stops are sent while the head's is
#   still in flight.
# - A node lost (unreachable past the grace): decide() reports the replica lost, the reconciler
#   drops its record, and its surviving shards are stopped later as "stale" engines in the order
#   of the catalog's nodes, not by rank: a worker listed before its head is stopped first.
#
# The dispatcher is the project's RecordingDispatcher (the controller's side is what is tested:
# which stop it sends when), with one change: a stop can be held open, so the order is seen
# without timing anything.
# The head on n2: the catalog lists a worker's node (n1) before it, as nodes.yaml may.
RANKS = {"n2": 0, "n1": 1, "n3": 2}
RID = "smol-g7"


class HeldStops(RecordingDispatcher):
    """Records when each stop is sent and when it returns; the head's stop is held until released."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []
        self.head_entered = asyncio.Event()
        self.release = asyncio.Event()

    async def call(self, node_id: str, verb: str, request: Any, *, timeout: float | None = None) -> Any:
        if verb != "stop":
            return await super().call(node_id, verb, request, timeout=timeout)
        agent_id = request["replica_id"]
        self.log.append(("sent", agent_id))
        if agent_id == shard_agent_id(RID, 0):
            self.head_entered.set()
            await self.release.wait()
        answer = await super().call(node_id, verb, request, timeout=timeout)
        self.log.append(("returned", agent_id))
        return answer


def catalog() -> Catalog:
    nodes = tuple(NodeSpec(NodeId(n), f"10.1.0.{i}", fabric="lan", disk_gb=100)
                  for i, n in enumerate(NODES, start=1))
    return Catalog(models=(MODEL,), nodes=nodes)


async def running_replica(d: HeldStops) -> Replica:
    """A ready replica whose three shards run on the (recording) nodes."""
    for i, n in enumerate(NODES, start=1):
        d.add_node(n, engine_names=("llama.cpp", "rpc-server"), advertise_address=f"127.0.0.{i}")
    shards = []
    for n, rank in sorted(RANKS.items(), key=lambda kv: kv[1]):
        agent_id = shard_agent_id(RID, rank)
        answer = await d.start(n, {"replica_id": agent_id, "engine": "llama.cpp" if rank == 0 else "rpc-server",
                                   "args": [], "env": {}, "gpus": [], "port": None, "weights": None,
                                   "labels": {"llmgw.replica": RID, "llmgw.model": "smol",
                                              "llmgw.rank": str(rank), "llmgw.generation": "7"}})
        shards.append(ShardStatus(NodeId(n), rank, (), agent_id, pid=answer.get("pid"), port=answer.get("port"),
                                  endpoint=answer.get("endpoint"), state="started"))
    placement = Placement(ModelName("smol"), "split",
                          tuple(Shard(NodeId(s.node), s.rank, (), holds_weights=s.rank == 0) for s in shards),
                          memory_gb=1, size_gb=0.2, weights=MODEL.cache_name)
    return Replica(id=RID, model=ModelName("smol"), profile="split", placement=placement, generation=7,
                   fingerprint=fingerprint(MODEL, PROFILE), shards=tuple(shards), state=ReplicaState.READY)


def head_returned_before_any_worker_was_sent(log: list[tuple[str, str]]) -> bool:
    head = shard_agent_id(RID, 0)
    returned = log.index(("returned", head)) if ("returned", head) in log else len(log)
    workers_sent = [i for i, (what, who) in enumerate(log) if what == "sent" and who != head]
    return bool(workers_sent) and all(i > returned for i in workers_sent)


def test_llmgw_up_shutdown_stops_the_head_before_its_workers(tmp_path: Path) -> None:
    async def main() -> list[tuple[str, str]]:
        d = HeldStops()
        store = Store(tmp_path / "llmgw.db").open()
        rec = Reconciler(DesiredState(catalog()), LiveInventory(d, store), d, store,
                         config=ReconcilerConfig(stop_grace=1))
        await rec.start(loop=False)
        try:
            r = await running_replica(d)
            rec.replicas[r.id] = r
            stopping = asyncio.create_task(rec.stop_all())  # what `llmgw up` does on Ctrl-C
            await d.head_entered.wait()
            for _ in range(100):  # let every other task of the loop run (no clock involved)
                await asyncio.sleep(0)
            d.release.set()
            await stopping
            return d.log
        finally:
            await rec.close()

    log = asyncio.run(main())
    assert head_returned_before_any_worker_was_sent(log), f"stop order (sent/returned): {log}"


def test_a_lost_worker_node_stops_the_surviving_head_before_the_surviving_worker(tmp_path: Path) -> None:
    async def main() -> list[tuple[str, str]]:
        d = HeldStops()
        d.release.set()  # nothing held: only the order is read
        clock = [1000.0]
        store = Store(tmp_path / "llmgw.db").open()
        config = ReconcilerConfig(unreachable_grace=30)
        rec = Reconciler(DesiredState(catalog()), LiveInventory(d, store, clock=lambda: clock[0]), d, store,
                         config=config, clock=lambda: clock[0])
        await rec.start(loop=False)
        try:
            r = await running_replica(d)
            rec.replicas[r.id] = r
            await rec.tick()
            d.nodes["n3"].reachable = False  # the node of worker rank 2 goes away
            for _ in range(4):
                clock[0] += 20
                await rec.tick()
            assert RID not in rec.replicas, f"the replica was not given up as lost: {rec.replicas}"
            return d.log
        finally:
            await rec.close()

    log = asyncio.run(main())
    stops = [who for what, who in log if what == "sent"]
    assert shard_agent_id(RID, 0) in stops and shard_agent_id(RID, 1) in stops, log
    assert stops.index(shard_agent_id(RID, 0)) < stops.index(shard_agent_id(RID, 1)), (
        f"after n3 was lost the surviving shards were stopped in this order: {stops} (rank 1 before the head)")
