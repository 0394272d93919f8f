"""The reconciler: each tick, decide (pure) and then carry the decisions out.

Runs on every tick and at once when woken (a new catalog, a held request, an operator
action). Replica records are persisted after every change, so a controller killed at
any point adopts the engines the agents report instead of starting them again. Engines no
record claims, on the nodes whose lease this controller holds, are judged by
:func:`llmgw.decide.adopt.adopt` before each decision: adopted when they are what the catalog
asks for (a new leader, an older copy of the data dir, an empty one), else stopped (a replica
given up with its node, which then came back; a version or a model no longer wanted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from llmgw.catalog import Catalog, NodeId, NodeSpec
from llmgw.contract import Endpoint, EndpointSink, NoUsage, UsageSource
from llmgw.decide.adopt import Adoption, adopt
from llmgw.decide.demand import believed_demand
from llmgw.decide.replica import Replica, ReplicaState, fingerprint, replica_id, runs, shard_agent_id
from llmgw.decide.replica import ShardStatus as _ShardStatus
from llmgw.decide.rollout_rule import settled
from llmgw.decide.tick import Decisions, Settings, decide
from llmgw.dispatch.base import Dispatcher
from llmgw.engines.health import read_load
from llmgw.errors import DispatchError
from llmgw.gitops.desired import DesiredState
from llmgw.health import Tracker
from llmgw.inventory import EngineRecord, Inventory, NodeState, becomes_ours, engine_is_ours, parse_engine
from llmgw.placement import unrunnable
from llmgw.reconciler.config import ReconcilerConfig
from llmgw.reconciler.lifecycle import Lifecycle
from llmgw.reconciler.live import LiveInventory
from llmgw.reconciler.rollouts import Plan, RolloutDriver
from llmgw.store.protocol import Store
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Replica ids this controller gave up (stopped, or lost with a node) that it remembers: an engine of
# one still running is stale, never adopted again. Beyond this many, the oldest are forgotten (the
# generation rule of llmgw.decide.adopt still holds for this controller's own).
GIVEN_UP_KEPT = 4096
# Seconds a replica drains on the routers' word alone; after that, only while its engine counts
# requests (requests sent before it was withdrawn reach the engine well within this).
DRAIN_CONFIRM_AFTER = 5.0
# Seconds after this reconciler starts (a restart, a new leader) in which routers may not have
# reported to it yet: a drain it finds is held while its engine counts requests, not ended because
# no router said any (a new leader's first tick cut the streams of drains its predecessor began).
REPORTS_SETTLE = 10.0


class Reconciler:
    """Makes the fleet match the desired state. ``start()`` begins the loop; ``close()`` ends it."""

    def __init__(
        self,
        desired: DesiredState,
        inventory: LiveInventory,
        dispatcher: Dispatcher,
        store: Store,
        *,
        sink: EndpointSink | None = None,
        usage: UsageSource | None = None,
        config: ReconcilerConfig | None = None,
        clock: Callable[[], float] = time.time,
        manages: Callable[[NodeSpec], bool] = lambda _: True,
        holder: str | None = None,
    ) -> None:
        self.desired = desired
        self.inventory = inventory
        self.dispatcher = dispatcher
        self.store = store
        self.sink = sink
        self.usage: UsageSource = usage or NoUsage()
        self.config = config or ReconcilerConfig()
        self.clock = clock
        self.manages = manages
        self.holder = holder  # this controller's lease holder id: engines stamped otherwise are not ours
        self._foreign_seen: set[tuple[str, str]] = set()
        self._given_up: dict[str, None] = {}  # ordered: the oldest are forgotten first
        self._waiting_seen: set[str] = set()
        self._issued = 0  # the store's generation counter when this life began (llmgw.decide.adopt)
        self._past = 0  # a generation the store's counter is known to be at or past
        self.replicas: dict[str, Replica] = {}
        self.last_decisions = Decisions()
        # Per model, in-flight requests the routers reported that its engines did not count (not
        # scaled for: llmgw.decide.demand), as of the last tick.
        self.unconfirmed_demand: dict[str, int] = {}
        self.health = Tracker("reconcile")
        self._drain_said: dict[str, str] = {}  # replica → the drain wait last said of it
        self._published: tuple | None = None
        self._unrunnable: dict[str, str] | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tick_lock = asyncio.Lock()
        self._started_at = float("-inf")  # when start() ran: routers' reports settle after it
        self.lifecycle: Lifecycle | None = None
        self._nodes_for: Catalog | None = None
        self._saved: tuple[Replica, ...] | None = None
        # Whether this controller may still write the fleet's records (a shared store: it leads).
        # A leader that stalled past its lease and resumed must not overwrite, with what it saw
        # before, the records its successor keeps in the same store.
        self.may_act: Callable[[], bool] = lambda: True
        self.rollouts = RolloutDriver(store, clock=clock)
        self._running: Catalog | None = None  # the catalog with each model on its serving version

    # --- lifecycle ------------------------------------------------------------------
    async def start(self, *, loop: bool = True) -> None:
        self._wake = asyncio.Event()
        self._session = aiohttp.ClientSession()
        self.lifecycle = Lifecycle(self.dispatcher, self._session, self.store, self.config, self.clock)
        self.rollouts.load()
        self._issued = self._past = self.store.generation()
        self._started_at = self.clock()
        for r in self.store.replicas():
            if r.state == ReplicaState.READY:
                # Adopted from a previous life: probed before it serves again, never restarted. Its
                # start_timeout counts from now: from its old state_since (hours ago, often), one
                # probe a busy engine answered late failed it, and every loaded replica was
                # stopped at a controller's restart.
                r = replace(r, state=ReplicaState.STARTING, adopted=True, state_since=self.clock())
            self.replicas[r.id] = r
        if loop:
            self._task = asyncio.create_task(self._run(), name="reconciler")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def notify(self) -> None:
        """Run a tick now (a catalog change, a held request, an operator action)."""
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive a bug; logged, counted, in status
                log.exception("reconcile tick failed")
                self.health.failed(self.clock(), exc)
            else:
                self.health.ok(self.clock())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.tick_interval)
            except TimeoutError:
                pass

    # --- one tick -----------------------------------------------------------------------
    async def tick(self) -> Decisions:
        async with self._tick_lock:
            catalog = self.desired.catalog
            if catalog is None:
                return Decisions()
            if catalog is not self._nodes_for:
                await self._follow_nodes(catalog)
            inventory = await self.inventory.poll()
            now = self.clock()
            self._observe(inventory, now)
            plan = self.rollouts.plan(catalog, self.replicas, self.usage.replica_stats, now)
            self._running = plan.catalog
            self._settle_canaries(plan)
            # Before decide(): adopted replicas count toward the model's, so none is placed beside them.
            self._adopt(plan, inventory, now)
            queue = self.usage.engine_queue() if self.usage.reads_engines else None
            believed = believed_demand(self.usage.demand(), queue, self.replicas.values())
            self.unconfirmed_demand = believed.unconfirmed
            decisions = decide(
                plan.catalog, inventory, list(self.replicas.values()),
                last_used=self.usage.last_used(), demand=believed.demand, now=now,
                settings=Settings(unreachable_grace=self.config.unreachable_grace),
                canaries=plan.canaries, canary_notes=plan.notes, pinned=plan.pinned,
            )
            self.last_decisions = decisions
            self._say_drain_waits(decisions)
            self._publish_unrunnable(plan.catalog, inventory)
            created = self._apply_decisions(plan, decisions, now)
            self.rollouts.decided(decisions, created, now, self.replicas.values())
            # Recorded before any start is sent: a leader that dies between a start and the end
            # of its tick leaves an engine its successor finds a record for (and keeps), not one
            # it must take for given up and stop.
            self._save()
            if self.lifecycle is not None:  # the fetch progress of replicas no longer fetching goes
                self.lifecycle.fetches = {rid: f for rid, f in self.lifecycle.fetches.items()
                                          if (r := self.replicas.get(rid)) is not None
                                          and r.state == ReplicaState.FETCHING}
            # Withdrawn from the router before anything is stopped.
            self.publish()
            await self._stop_stale_engines(plan, inventory, now)
            await self._advance_all(plan, inventory)
            self._save()
            if self.may_act():
                self.rollouts.save()
            self.publish()
            return decisions

    def _say_drain_waits(self, d: Decisions) -> None:
        """A drain that cannot finish says why, once per replica and reason (seen: a drain of a node
        holding one shard of a two-node replica waited forever without a word)."""
        for rid, why in d.drain_waits.items():
            if self._drain_said.get(rid) != why and rid in self.replicas:
                nodes = ", ".join(sorted(set(self.replicas[rid].nodes)))
                self.store.add_event("drain-waits", nodes, f"drain of {nodes} waits for replica {rid}: {why}")
        self._drain_said = dict(d.drain_waits)

    def _settle_canaries(self, plan: Plan) -> None:
        """A promoted canary is an ordinary replica of the version now serving (decide.rollout_rule.settled)."""
        for rid, r in list(self.replicas.items()):
            if not r.canary or r.model in plan.canaries:
                continue
            model = plan.catalog.model(r.model)
            if model is None or not runs(r, model):
                continue  # a canary of a rollout that ended: decide() stops it
            self.replicas[rid] = settled(r, model, list(self.replicas.values()))

    async def _follow_nodes(self, catalog: Catalog) -> None:
        """Point the inventory and the dispatcher at the catalog's nodes before polling them."""
        nodes = [n for n in catalog.nodes if self.manages(n)]
        self.inventory.set_nodes(nodes)
        set_nodes = getattr(self.dispatcher, "set_nodes", None)
        if set_nodes is not None:
            await set_nodes(nodes)
        self._nodes_for = catalog

    def _observe(self, inventory: Inventory, now: float) -> None:
        """Fold what the agents report into the records: exits of ready engines."""
        assert self.lifecycle is not None
        for rid, r in list(self.replicas.items()):
            self.replicas[rid] = self.lifecycle.observe(r, inventory, now)

    def _apply_decisions(self, plan: Plan, d: Decisions, now: float) -> dict[str, str]:
        """Carry out the tick's decisions on the records; returns the canaries created (model → id)."""
        catalog = plan.catalog
        canaries: dict[str, str] = {}
        for rid, why in d.lost:
            r = self.replicas.pop(rid, None)
            if r is not None:
                self._give_up(rid)
                self.store.add_event("replica-lost", rid, f"{r.model}: {why}; placing it elsewhere")
        for rid, why in d.stop:
            r = self.replicas.get(rid)
            if r is not None and r.state not in (ReplicaState.STOPPING, ReplicaState.STOPPED):
                self.replicas[rid] = r.moved(ReplicaState.STOPPING, now, stop_reason=why)
                self.store.add_event("replica-stopping", rid, f"{r.model}: {why}")
        for new in d.create:
            want = plan.canaries.get(new.placement.model) if new.canary else None
            model = want.spec if want is not None else catalog.model(new.placement.model)
            profile = model.profile(new.placement.profile) if model else None
            if model is None or profile is None:
                continue
            generation = self.store.next_generation()
            self._past = max(self._past, generation)
            rid = replica_id(model.name, generation)
            shards = tuple(_ShardStatus(s.node, s.rank, s.gpus, shard_agent_id(rid, s.rank))
                           for s in new.placement.shards)
            self.replicas[rid] = Replica(
                id=rid, model=model.name, profile=profile.name, placement=new.placement,
                generation=generation, fingerprint=fingerprint(model, profile), shards=shards,
                created_at=now, state_since=now, replaces=new.replaces, revision=catalog.revision,
                canary=want is not None,
            )
            if want is not None:
                canaries[model.name] = rid
            where = ", ".join(f"{s.node} gpus {list(s.gpus)}" for s in new.placement.shards)
            self.store.add_event("replica-created", rid, f"{model.name}/{profile.name} on {where}: {new.reason}")
        return canaries

    def _judge_unclaimed(self, plan: Plan, inventory: Inventory, now: float) -> Adoption:
        """What :func:`adopt` makes of the engines no record claims, on the nodes this controller holds."""
        return adopt(plan.catalog, inventory, list(self.replicas.values()), now=now, holder=self.holder,
                     issued=self._issued, given_up=self._given_up.keys(), canaries=plan.canaries,
                     unreachable_grace=self.config.unreachable_grace)

    def _adopt(self, plan: Plan, inventory: Inventory, now: float) -> None:
        """Take over the engines that are what the catalog asks for: their records rebuilt, in state
        starting (probed once before they serve, never restarted). What is not adopted is stopped
        later in the tick (:meth:`_stop_stale_engines`), after the router has its new list."""
        found = self._judge_unclaimed(plan, inventory, now)
        if found.highest > self._past:
            # Past every generation adopted (or seen on a node): no new replica takes one's id.
            self._past = self.store.next_generation(above=found.highest)
        for r in found.adopt:
            self.replicas[r.id] = r
            self._waiting_seen.discard(r.id)
            self.store.add_event("replica-adopted", r.id, f"{r.model}/{r.profile}: {_engines_of(r, inventory)}; "
                                 "adopted (probed before it serves, not restarted)")
        for rid, why in found.waiting:
            if rid not in self._waiting_seen:
                self._waiting_seen.add(rid)
                log.info("engines of replica %s neither adopted nor stopped yet: %s", rid, why)

    def _give_up(self, rid: str) -> None:
        """Remember that ``rid`` is no longer this controller's: an engine of it found later is stale."""
        self._given_up[rid] = None
        while len(self._given_up) > GIVEN_UP_KEPT:
            del self._given_up[next(iter(self._given_up))]

    async def _stop_stale_engines(self, plan: Plan, inventory: Inventory, now: float) -> None:
        """Stop the engines adoption does not take (:func:`adopt`: each with its reason, in the
        event), on nodes whose lease this controller holds, whoever started them; replicas given up
        this very tick (lost with a node) are among them.

        On a node another controller drives (fenced) its engines are reported once and left running
        (seen: two controllers stopped each other's engines); on a node being handed over from an
        earlier instance of ours nothing is done until it is ours: its engines may be adopted.
        """
        assert self.lifecycle is not None
        for node in inventory.nodes.values():
            if node.report is None or node.state != NodeState.FENCED:
                continue
            for e in node.report.engines:
                if e.alive and e.label("llmgw.replica") is not None:
                    self._report_foreign(node.id, e)
        found = self._judge_unclaimed(plan, inventory, now)
        # Head first (DESIGN §5): the surviving shards of a replica given up with a node come here
        # in nodes.yaml order, where a worker's node may come before its head's.
        for stale in sorted(found.stop, key=lambda x: x.rank):
            if await self.lifecycle.stop_engine(stale.node, stale.agent_id):
                pid = f" (pid {stale.pid})" if stale.pid is not None else ""
                self.store.add_event("stale-engine-stopped", stale.agent_id,
                                     f"engine {stale.agent_id} on {stale.node}{pid}: {stale.reason}; stopped")

    def _report_foreign(self, node_id: str, e: EngineRecord) -> None:
        if (node_id, e.replica_id) in self._foreign_seen:
            return
        self._foreign_seen.add((node_id, e.replica_id))
        self.store.add_event("foreign-engine", e.replica_id,
                             f"engine {e.replica_id} on {node_id} (model {e.label('llmgw.model') or '?'}, pid {e.pid}) "
                             f"was started by controller {e.holder or '?'} (epoch {e.epoch}); left running, its GPUs "
                             "counted as taken")

    async def _advance_all(self, plan: Plan, inventory: Inventory) -> None:
        assert self.lifecycle is not None
        sem = asyncio.Semaphore(self.config.concurrency)
        lifecycle = self.lifecycle
        # A canary runs the catalog's new version; every other replica its model's serving one.
        desired = self.desired.catalog or plan.catalog

        async def one(r: Replica) -> Replica:
            async with sem:
                return await lifecycle.advance(r, desired if r.canary else plan.catalog, inventory)

        # On a node that becomes ours once its silent holder's lease lapses nothing is asked
        # of the node (it would refuse), and its replicas are kept (not failed, not lost) until the
        # node is ours. Adopted engines are probed meanwhile (HTTP to the engine, no command): the
        # router serves them again at once instead of after the grace.
        waiting = {n.id for n in inventory.nodes.values() if becomes_ours(n)}
        draining = await self._draining(waiting, desired)
        current = [r for r in self.replicas.values() if r.id not in draining and (
                   (r.state == ReplicaState.STARTING and r.adopted) or not waiting.intersection(r.nodes))]
        results = await asyncio.gather(*(one(r) for r in current))
        for r in results:
            if r.state == ReplicaState.STOPPED:
                self.replicas.pop(r.id, None)
                self._give_up(r.id)
            elif r.id in self.replicas:
                self.replicas[r.id] = r

    async def _draining(self, handover: set[NodeId], catalog: Catalog) -> set[str]:
        """Replicas on their way out whose engine is kept a while: withdrawn from the routers (the
        tick published the list without them before this), with requests still in flight on them
        or a router not yet serving without them. Stopped at once when nothing is left, at
        ``drain_timeout`` whatever is (an event says how many were cut), and once it has drained
        DRAIN_CONFIRM_AFTER seconds, as soon as its engine counts nothing running or waiting: a
        router's word alone (a router host taken over) held a stop for the whole drain timeout.
        Replicas on a node in ``handover`` are not advanced this tick anyway: not judged (nor
        their event repeated)."""
        stopping = [r for r in self.replicas.values()
                    if r.state == ReplicaState.STOPPING and not handover.intersection(r.nodes)]
        if not stopping:
            return set()
        in_flight = self.usage.in_flight_by_replica()
        now = self.clock()
        out = set()
        for r in stopping:
            n = in_flight.get(r.id, 0)
            if n <= 0:
                if (now - self._started_at < REPORTS_SETTLE and now - r.state_since < self.config.drain_timeout
                        and not await self._engine_idle(r, catalog)):
                    out.add(r.id)  # routers may not have found this controller yet; its engine is busy
                continue
            if now - r.state_since >= self.config.drain_timeout:
                self.store.add_event("replica-drain-timeout", r.id,
                                     f"{r.model}: {n} request(s) still in flight after drain_timeout "
                                     f"{self.config.drain_timeout:g}s (a router not yet serving without it "
                                     "counts one); stopping it anyway")
            elif now - r.state_since >= DRAIN_CONFIRM_AFTER and await self._engine_idle(r, catalog):
                self.store.add_event("replica-drain-unconfirmed", r.id,
                                     f"{r.model}: routers report {n} request(s) in flight (or that they may still "
                                     f"send one) after {now - r.state_since:.0f}s of draining, and its engine "
                                     "counts none running or waiting; stopping it")
            else:
                out.add(r.id)
        return out

    async def _engine_idle(self, r: Replica, catalog: Catalog) -> bool:
        """Whether the replica's engine reads as idle (nothing running or waiting); not read: no."""
        if r.endpoint is None or self._session is None:
            return False
        model = catalog.model(r.model)  # a model retired from the catalog: its engine is guessed from the answer
        profile = model.profile(r.profile) if model is not None else None
        load = await read_load(self._session, r.endpoint, profile.engine if profile else None)
        return load is not None and load.running + load.waiting == 0

    def _save(self) -> None:
        """Persist the replica records, only when they changed (a tick usually changes nothing)."""
        records = tuple(self.replicas.values())  # frozen records: equal when nothing changed
        if records != self._saved and self.may_act():
            self.store.save_replicas(records)
            self._saved = records

    # --- the router's view ------------------------------------------------------------
    def endpoints(self, catalog: Catalog) -> list[Endpoint]:
        """The ready replicas for the router; ``catalog``: each model on its serving version."""
        out = []
        desired = self.desired.catalog or catalog
        for r in sorted(self.replicas.values(), key=lambda r: r.id):
            model = (desired if r.canary else catalog).model(r.model)
            profile = model.profile(r.profile) if model else None
            if r.state != ReplicaState.READY or model is None or profile is None or not r.endpoint:
                continue
            out.append(Endpoint(
                replica_id=r.id, model=model.name, names=model.names, url=r.endpoint.rstrip("/"),
                engine=profile.engine, profile=profile.name, priority=profile.priority, task=model.task,
                node=r.shards[0].node, ready_since=r.ready_since or 0.0,
                canary=r.canary, canary_percent=self.rollouts.canary_percent(r.model),
            ))
        return out

    def publish(self, catalog: Catalog | None = None) -> None:
        """Send ready endpoints to the router, only when the list changed."""
        catalog = catalog or self._running or self.desired.catalog
        if self.sink is None or catalog is None:
            return
        eps = self.endpoints(catalog)
        key = tuple((e.replica_id, e.url, e.names, e.priority, e.ready_since, e.canary, e.canary_percent)
                    for e in eps)
        if key == self._published:
            return
        self._published = key
        self.sink.set_endpoints(eps)

    def _publish_unrunnable(self, catalog: Catalog, inventory: Inventory) -> None:
        """Tell the router which models no node can run, so it answers them at once."""
        if self.sink is None:
            return
        ready = {r.model for r in self.replicas.values() if r.state == ReplicaState.READY}
        names = [m.name for m in catalog.models if m.name not in ready and m.scaling.max > 0]
        # A node being handed over is this controller's within the grace: what it could run is
        # not "cannot run" (the router would refuse at once requests it should hold).
        handed = {k: replace(n, state=NodeState.READY) for k, n in inventory.nodes.items() if becomes_ours(n)}
        reasons = unrunnable(catalog, Inventory({**inventory.nodes, **handed}, inventory.taken_at) if handed
                             else inventory, names)
        if reasons != self._unrunnable:
            self._unrunnable = reasons
            self.sink.set_unrunnable(reasons)

    async def stop_all(self) -> None:
        """Stop every replica's engines now (for `llmgw up`, whose engines end with it)."""
        assert self.lifecycle is not None
        async with self._tick_lock:
            # Replicas side by side, each head first, then its workers (DESIGN §5): a head whose
            # workers go first fails its clients' requests, and a llama.cpp head aborts.
            await asyncio.gather(*(self._stop_in_rank_order([(s.node, s.agent_id) for s in r.shards])
                                   for r in self.replicas.values()))
            # A start cut short by shutdown may have run on the node without its answer reaching
            # us: ask each node what it runs under our labels, so nothing is left behind.
            leftovers: list[tuple[str, str]] = []
            for node_id, node in self.inventory.snapshot().nodes.items():
                try:
                    engines = [parse_engine(e) for e in (await self.dispatcher.status(node_id)).get("engines") or []]
                except DispatchError as exc:
                    log.info("stop all: %s did not answer: %s", node_id, exc)
                    continue
                # Ours only: an engine another controller started (the node stamped its lease) is not
                # this one's to stop, even at shutdown (seen: `up` stopping a takeover's engines).
                lease = node.report.lease if node.report is not None else None
                leftovers += [(node_id, e.replica_id) for e in engines
                              if e.alive and e.label("llmgw.replica") is not None
                              and engine_is_ours(e, lease, holder=self.holder)]
            await self._stop_in_rank_order(leftovers)
            self.replicas.clear()
            self._save()

            self._published = None
            self.publish()

    async def _stop_in_rank_order(self, engines: list[tuple[str, str]]) -> None:
        """Stop (node, agent id) pairs one at a time, rank 0 (the head) first."""
        assert self.lifecycle is not None
        for node_id, agent_id in sorted(engines, key=lambda e: _rank_of(e[1])):
            await self.lifecycle.stop_engine(node_id, agent_id)

    def snapshot(self) -> list[Replica]:
        return sorted(self.replicas.values(), key=lambda r: r.id)


def _rank_of(agent_id: str) -> int:
    """The rank in a shard's agent id (:func:`shard_agent_id`: ``<replica>.r<rank>``); 0 otherwise."""
    _, sep, rank = agent_id.rpartition(".r")
    return int(rank) if sep and rank.isascii() and rank.isdigit() else 0


def _engines_of(r: Replica, inventory: Inventory) -> str:
    """``n1 gpus [0] pid 4242 (started by controller c-1 at epoch 1), ...`` for an adopted replica."""
    out = []
    for s in r.shards:
        node = inventory.node(s.node)
        e = next((x for x in node.report.engines if x.replica_id == s.agent_id), None) \
            if node is not None and node.report is not None else None
        by = f" (started by controller {e.holder} at epoch {e.epoch})" if e is not None and e.holder else ""
        rank = f" rank {s.rank}" if len(r.shards) > 1 else ""
        out.append(f"{s.node}{rank} gpus {list(s.gpus)} pid {s.pid}{by}")
    return f"generation {r.generation} on " + ", ".join(out)
