"""The reconciler applying adoption (issue 36), over the shipped recording dispatcher with a lease per
node: a controller that takes nodes over adopts the engines another started (same ids, same pids,
nothing started beside them) and stops the ones the catalog no longer asks for; on a node another
controller drives, or one still being handed over, it touches nothing; an engine of a replica it
gave up stays stale, in this life and the next. No clock is waited on: time is a variable."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from llmgw.catalog import Catalog, Model, ModelName, NodeId, NodeSpec, Profile, Scaling
from llmgw.catalog.model import GpuSpec
from llmgw.decide.replica import ReplicaState
from llmgw.dispatch.recording import FakeNode, RecordingDispatcher
from llmgw.gitops.desired import DesiredState
from llmgw.reconciler.config import ReconcilerConfig
from llmgw.reconciler.live import LiveInventory
from llmgw.reconciler.reconciler import Reconciler
from llmgw.store.sqlite import SqliteStore as Store

NODES = ("n1", "n2")


def sim(name: str, *, min_: int, max_: int, args: tuple[str, ...] = ()) -> Model:
    return Model(name=ModelName(name), source=f"sim://{name}", size_gb=0.1, scaling=Scaling(min=min_, max=max_),
                 profiles=(Profile(name="sim", priority=0, engine="sim", gpus=1, gpu_class=("sim",), args=args),))


def catalog(*models: Model, nodes: tuple[str, ...] = NODES) -> Catalog:
    return Catalog(models=models, nodes=tuple(NodeSpec(NodeId(n), f"10.0.0.{i}", gpus=GpuSpec(2, "sim", 24))
                                              for i, n in enumerate(nodes, start=1)))


class LeasedNodes(RecordingDispatcher):
    """The recording dispatcher with each node's lease as a fenced poll shows it (DESIGN §4): who
    holds it, at which epoch, whether that is the asker; each engine stamped with the lease it was
    started under, as a node stamps it."""

    def __init__(self, holder: str) -> None:
        # Ports nothing listens on (the fake runs no engine): a probe is refused at once.
        super().__init__({n: FakeNode(hostname=n, port_range=(9, 19)) for n in NODES})
        self.lease: dict[str, dict[str, Any]] = {}
        for n in NODES:
            self.hold(n, holder, epoch=1)

    def hold(self, node: str, holder: str, *, epoch: int, held: bool = True, sibling: bool = False) -> None:
        self.lease[node] = {"holder": holder, "epoch": epoch, "expires": None, "held": held, "sibling": sibling,
                            "heard": None, "grace": 20.0}

    def _inventory(self, node: FakeNode, request: Any) -> Any:
        return {**super()._inventory(node, request), "lease": self.lease[node.hostname]}

    def _start(self, node: FakeNode, request: Any) -> Any:
        answer = super()._start(node, request)
        lease = self.lease[node.hostname]
        node.engines[request["replica_id"]].update(holder=lease["holder"], epoch=lease["epoch"])
        return answer

    def pids(self) -> dict[str, int]:
        return {rid: e["pid"] for n in self.nodes.values() for rid, e in n.engines.items()}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def controller(d: LeasedNodes, store: Store, cat: Catalog, holder: str, clock: Clock) -> Reconciler:
    return Reconciler(DesiredState(cat), LiveInventory(d, store, clock=clock), d, store, holder=holder, clock=clock,
                      config=ReconcilerConfig(probe_timeout=1.0, stop_grace=1.0, unreachable_grace=30.0))


async def ticks(rec: Reconciler, clock: Clock, n: int = 3) -> None:
    for _ in range(n):
        clock.now += 1
        await rec.tick()


def kinds(store: Store, kind: str) -> list[str]:
    return [e.message for e in store.events() if e.kind == kind]


async def first_life(d: LeasedNodes, tmp_path: Path, cat: Catalog, clock: Clock) -> dict[str, int]:
    """A controller ``ctl-a`` starts the catalog's replicas, then is gone without a word (kill -9)."""
    store = Store(tmp_path / "a.db").open()
    rec = controller(d, store, cat, "ctl-a", clock)
    await rec.start(loop=False)
    await ticks(rec, clock)
    assert all(r.state == ReplicaState.STARTING and r.shards[0].pid for r in rec.replicas.values())
    await rec.close()
    store.close()
    return d.pids()


def test_a_controller_on_an_empty_data_dir_adopts_what_the_catalog_asks_for_and_stops_the_rest(tmp_path) -> None:
    async def main() -> None:
        d, clock = LeasedNodes("ctl-a"), Clock()
        before = await first_life(d, tmp_path, catalog(sim("chat", min_=2, max_=2), sim("old", min_=1, max_=1)),
                                  clock)
        assert sorted(before) == ["chat-g1.r0", "chat-g2.r0", "old-g3.r0"]
        # Its leases lapse; the new controller gets the nodes at a higher epoch. "old" left the catalog.
        for n in NODES:
            d.hold(n, "ctl-b", epoch=2)
        store = Store(tmp_path / "b.db").open()
        rec = controller(d, store, catalog(sim("chat", min_=2, max_=2)), "ctl-b", clock)
        await rec.start(loop=False)
        d.calls.clear()
        await ticks(rec, clock)
        assert d.calls_of("start") == []  # nothing started beside them
        assert sorted(rec.replicas) == ["chat-g1", "chat-g2"]
        assert {s.agent_id: s.pid for r in rec.replicas.values() for s in r.shards} == \
            {k: v for k, v in before.items() if k.startswith("chat")}
        assert all(r.adopted and r.state == ReplicaState.STARTING for r in rec.replicas.values())  # probed first
        adopted = kinds(store, "replica-adopted")
        assert len(adopted) == 2 and f"pid {before['chat-g1.r0']} (started by controller ctl-a at epoch 1)" in \
            next(m for m in adopted if m.startswith("chat/sim: generation 1 "))
        assert [c.request["replica_id"] for c in d.calls_of("stop")] == ["old-g3.r0"]
        assert kinds(store, "stale-engine-stopped") == [
            f"engine old-g3.r0 on {d.calls_of('stop')[0].node_id} (pid {before['old-g3.r0']}): model old left "
            "the catalog; stopped"]
        assert kinds(store, "foreign-engine") == []
        # The counter is past every generation it saw: a new replica takes no adopted one's id.
        assert store.generation() >= 3
        rec.desired.set(catalog(sim("chat", min_=3, max_=3)))
        await ticks(rec, clock, 1)
        (new,) = [r for r in rec.replicas.values() if not r.adopted]
        assert new.generation > 3 and new.id not in before
        await rec.close()
        store.close()

    asyncio.run(main())


def test_a_stale_version_is_stopped_and_replaced_not_adopted(tmp_path) -> None:
    async def main() -> None:
        d, clock = LeasedNodes("ctl-a"), Clock()
        before = await first_life(d, tmp_path, catalog(sim("chat", min_=1, max_=1)), clock)
        for n in NODES:
            d.hold(n, "ctl-b", epoch=2)
        store = Store(tmp_path / "b.db").open()
        rec = controller(d, store, catalog(sim("chat", min_=1, max_=1, args=("--seed", "2"))), "ctl-b", clock)
        await rec.start(loop=False)
        await ticks(rec, clock, 1)
        (stopped,) = kinds(store, "stale-engine-stopped")
        assert stopped.startswith(f"engine chat-g1.r0 on n1 (pid {before['chat-g1.r0']}): stale version of chat/sim")
        assert kinds(store, "replica-adopted") == []
        (r,) = rec.replicas.values()  # a new one, of the catalog's version, numbered past the old
        assert not r.adopted and r.generation > 1
        await rec.close()
        store.close()

    asyncio.run(main())


def test_nothing_is_judged_on_a_node_another_controller_drives_or_that_is_being_handed_over(tmp_path) -> None:
    async def main() -> None:
        d, clock = LeasedNodes("ctl-a"), Clock()
        before = await first_life(d, tmp_path, catalog(sim("chat", min_=2, max_=2), nodes=("n1",)), clock)
        store = Store(tmp_path / "b.db").open()
        rec = controller(d, store, catalog(sim("chat", min_=2, max_=2), nodes=("n1",)), "ctl-b", clock)
        await rec.start(loop=False)
        d.calls.clear()
        # ctl-a still holds n1 (alive, for all ctl-b knows): its engines are reported, left running.
        d.hold("n1", "ctl-a", epoch=1, held=False)
        await ticks(rec, clock)
        assert rec.replicas == {} and d.calls_of("stop") == [] and d.calls_of("start") == []
        assert len(kinds(store, "foreign-engine")) == 2
        # A node held by an earlier instance of this very controller, not silent long enough yet.
        d.hold("n1", "ctl-b", epoch=1, held=False, sibling=True)
        await ticks(rec, clock)
        assert rec.replicas == {} and d.calls_of("stop") == [] and d.calls_of("start") == []
        # Then the node is this controller's: the engines are adopted.
        d.hold("n1", "ctl-b", epoch=2)
        await ticks(rec, clock, 1)
        assert sorted(s.pid for r in rec.replicas.values() for s in r.shards) == sorted(before.values())
        assert d.calls_of("stop") == [] and d.calls_of("start") == []
        await rec.close()
        store.close()

    asyncio.run(main())


def test_an_engine_of_a_replica_given_up_with_its_node_is_stopped_when_the_node_returns(tmp_path) -> None:
    """Not adopted, though its model has room for it: its replacement serves already."""
    async def main() -> None:
        d, clock = LeasedNodes("ctl-a"), Clock()
        store = Store(tmp_path / "a.db").open()
        rec = controller(d, store, catalog(sim("chat", min_=1, max_=3)), "ctl-a", clock)
        await rec.start(loop=False)
        await ticks(rec, clock)
        (first,) = rec.replicas.values()
        cut = first.nodes[0]
        d.set_reachable(cut, False)
        for _ in range(3):
            await ticks(rec, clock, 1)
            clock.now += 20
        assert first.id not in rec.replicas and len(rec.replicas) == 1  # given up, replaced elsewhere
        d.set_reachable(cut, True)
        await ticks(rec, clock, 1)
        assert [c.request["replica_id"] for c in d.calls_of("stop", cut)] == [first.shards[0].agent_id]
        assert kinds(store, "stale-engine-stopped") == [
            f"engine {first.id}.r0 on {cut} (pid {first.shards[0].pid}): replica {first.id} was given up by this "
            "controller (stopped, or lost with its node): stale; stopped"]
        assert kinds(store, "replica-adopted") == []
        await rec.close()

        # The same in its next life (the same data dir): numbered by it, claimed by no record.
        d.nodes[cut].engines[first.shards[0].agent_id] = {**_engine_of(first), "holder": "ctl-a", "epoch": 1}
        rec = controller(d, store, catalog(sim("chat", min_=1, max_=3)), "ctl-a", clock)
        await rec.start(loop=False)
        await ticks(rec, clock, 1)
        assert kinds(store, "stale-engine-stopped")[-1].endswith(
            f"generation {first.generation} was numbered by this controller (counter 2) and its replica given up "
            "(stale); stopped")
        assert kinds(store, "replica-adopted") == []
        await rec.close()
        store.close()

    asyncio.run(main())


def _engine_of(r: Any) -> dict[str, Any]:
    """The agent's record of a replica's head, as a lifecycle start left it (labels and all)."""
    from llmgw.inventory.model import EngineLabels

    s = r.shards[0]
    labels = EngineLabels(replica=r.id, model=r.model, profile=r.profile, rank=0, shards=1,
                          generation=r.generation, fingerprint=r.fingerprint).to_labels()
    return {"replica_id": s.agent_id, "pid": s.pid, "port": s.port, "endpoint": s.endpoint, "engine": "sim",
            "labels": labels, "weights": None, "gpus": list(s.gpus), "started_at": 0.0, "log": ""}


def test_an_engine_started_by_this_controller_carries_every_label_adoption_reads(tmp_path) -> None:
    async def main() -> None:
        d, clock = LeasedNodes("ctl-a"), Clock()
        await first_life(d, tmp_path, catalog(sim("chat", min_=1, max_=1)), clock)
        (start,) = d.calls_of("start")
        labels = start.request["labels"]
        assert labels == {**labels, "llmgw.replica": "chat-g1", "llmgw.model": "chat", "llmgw.profile": "sim",
                          "llmgw.rank": "0", "llmgw.shards": "1", "llmgw.generation": "1", "llmgw.canary": "false"}
        assert len(labels["llmgw.fingerprint"]) == 16

    asyncio.run(main())


def test_a_returned_record_is_saved_so_a_restart_claims_it(tmp_path) -> None:
    async def main() -> None:
        d, clock = LeasedNodes("ctl-a"), Clock()
        before = await first_life(d, tmp_path, catalog(sim("chat", min_=1, max_=1)), clock)
        for n in NODES:
            d.hold(n, "ctl-b", epoch=2)
        store = Store(tmp_path / "b.db").open()
        rec = controller(d, store, catalog(sim("chat", min_=1, max_=1)), "ctl-b", clock)
        await rec.start(loop=False)
        await ticks(rec, clock, 1)
        await rec.close()
        (saved,) = store.replicas()
        assert saved.adopted and saved.shards[0].pid == before["chat-g1.r0"]
        assert saved.state == ReplicaState.STARTING  # not probed ready here: nothing answers on the fake's ports
        store.close()

    asyncio.run(main())


def test_a_replica_is_recorded_before_its_start_is_sent(tmp_path) -> None:
    # A leader killed between a start and the end of its tick left an engine no record claimed:
    # its successor on the shared store took it for given up (its generation already issued)
    # and stopped it, a restart the failover promised not to make.
    class Recorded(LeasedNodes):
        def __init__(self, store: Store) -> None:
            super().__init__("ctl-a")
            self.store = store
            self.recorded_at_start: list[bool] = []

        def _start(self, node: FakeNode, request: Any) -> Any:
            rid = request["replica_id"].rsplit(".r", 1)[0]
            self.recorded_at_start.append(rid in {r.id for r in self.store.replicas()})
            return super()._start(node, request)

    async def main() -> None:
        store = Store(tmp_path / "a.db").open()
        d, clock = Recorded(store), Clock()
        rec = controller(d, store, catalog(sim("chat", min_=2, max_=2)), "ctl-a", clock)
        await rec.start(loop=False)
        await ticks(rec, clock, 1)
        await rec.close()
        store.close()
        assert d.recorded_at_start == [True, True]

    asyncio.run(main())


def test_a_controller_that_no_longer_leads_writes_no_record(tmp_path) -> None:
    # Review: a leader that stalled past its lease and resumed ran a tick before its lease loop
    # noticed, and saved what it had seen over the records its successor keeps in the shared store.
    async def main() -> None:
        store = Store(tmp_path / "a.db").open()
        d, clock = LeasedNodes("ctl-a"), Clock()
        rec = controller(d, store, catalog(sim("chat", min_=1, max_=1)), "ctl-a", clock)
        rec.may_act = lambda: False
        await rec.start(loop=False)
        await ticks(rec, clock, 2)
        assert store.replicas() == [] and store.rollout_records() == {}
        rec.may_act = lambda: True
        await ticks(rec, clock, 1)
        assert [r.model for r in store.replicas()] == ["chat"]
        await rec.close()
        store.close()

    asyncio.run(main())


def test_a_restarted_controller_gives_its_ready_replicas_their_start_timeout_from_the_restart(tmp_path) -> None:
    """Ready replicas kept in the store are probed again after a restart. Their start_timeout
    counted from when they first became ready (hours before, often), so one probe a busy engine
    answered late failed them, and every loaded replica was stopped at a controller's restart."""
    async def main() -> None:
        from dataclasses import replace

        d, clock = LeasedNodes("ctl-a"), Clock()
        cat = catalog(sim("chat", min_=1, max_=1))
        await first_life(d, tmp_path, cat, clock)
        store = Store(tmp_path / "a.db").open()
        store.save_replicas(tuple(replace(r, state=ReplicaState.READY) for r in store.replicas()))
        clock.now += 10 * ReconcilerConfig().start_timeout  # restarted much later
        rec = controller(d, store, cat, "ctl-a", clock)
        await rec.start(loop=False)
        await ticks(rec, clock)  # each probe refused (nothing listens on the fake's ports): not ready yet
        assert [(r.state, r.adopted) for r in rec.replicas.values()] == [(ReplicaState.STARTING, True)], \
            kinds(store, "replica-failed")
        await rec.close()
        store.close()

    asyncio.run(main())


def test_a_drain_found_at_a_restart_is_not_ended_before_routers_could_report(tmp_path) -> None:
    """A new leader (or a restarted controller) finds a replica draining. Its first tick comes
    before any router has reported to it: no report is not no requests. While its engine cannot be
    read idle, the drain is held until the routers had time to report (REPORTS_SETTLE); it used to
    be stopped at once, cutting its clients' streams."""
    async def main() -> None:
        from dataclasses import replace

        from llmgw.reconciler.reconciler import REPORTS_SETTLE

        d, clock = LeasedNodes("ctl-a"), Clock()
        cat = catalog(sim("chat", min_=1, max_=1))
        before = await first_life(d, tmp_path, cat, clock)
        store = Store(tmp_path / "a.db").open()
        store.save_replicas(tuple(replace(r, state=ReplicaState.STOPPING, state_since=clock.now)
                                  for r in store.replicas()))
        rec = controller(d, store, cat, "ctl-a", clock)
        await rec.start(loop=False)
        started = clock.now
        await ticks(rec, clock)  # its engine cannot be read (nothing listens on the fake's port): not idle
        assert [r.state for r in rec.replicas.values() if r.id == "chat-g1"] == [ReplicaState.STOPPING]
        assert d.pids()["chat-g1.r0"] == before["chat-g1.r0"]  # its engine still runs (a new one beside it)
        clock.now = started + REPORTS_SETTLE + 1  # no router said it has requests there: drained
        await ticks(rec, clock, 2)
        assert "chat-g1" not in rec.replicas and "chat-g1.r0" not in d.pids()
        await rec.close()
        store.close()

    asyncio.run(main())
