"""The control plane wired together: git → desired state → reconciler → nodes → router.

This is the one place that knows every part; each part knows only the narrow interfaces
it is given (the endpoint sink and the usage source toward the router, the dispatcher
toward the nodes), so the router can run in another process and nothing here changes.

With a PostgreSQL store several controllers share one database and one of them leads by the
store's lease (llmgw.control.leadership, DESIGN §5 "High availability"): each starts as a standby
that runs no reconciler, no git follower and sends no node command; the one that takes the lease
starts a fresh reconciler (which loads the replica records from the shared store and adopts the
running engines, as after a restart) and the follower (which restores the applied revision from
the store), and stops both, the reconciler first, when it loses the lease. With
SQLite (the default, `llmgw up`) the controller leads alone, without a lease loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from llmgw.catalog import Catalog
from llmgw.contract import EndpointSink, UsageSource
from llmgw.control.config import ControllerConfig
from llmgw.control.datadir import held_here, hold_data_dir, release_data_dir, succeed
from llmgw.control.fleet_dispatch import FleetDispatcher
from llmgw.control.fleet_metrics import FleetCollector, HealthCollector
from llmgw.control.keys import KeyBook
from llmgw.control.leadership import LEADER, Leadership, LeadershipCollector, LeadershipConfig
from llmgw.control.ops import FleetOps
from llmgw.control.router_credentials import RouterCredentials
from llmgw.control.usage import BudgetBook
from llmgw.dispatch.base import AgentVerbs
from llmgw.dispatch.fence import FencedDispatcher
from llmgw.errors import StoreError
from llmgw.gitops import DesiredState, GitMirror, GitOpsFollower
from llmgw.gitops.commit_status import CommitStatuses
from llmgw.gitops.desired import RECONCILER
from llmgw.gitops.repo import normalise_url
from llmgw.gitops.writer import CommitWriter
from llmgw.health import Health, Tracker
from llmgw.inventory import engine_is_ours
from llmgw.plan.guard import PruneVerdict, judge_prune
from llmgw.reconciler.live import LiveInventory
from llmgw.reconciler.reconciler import Reconciler
from llmgw.store.opening import is_postgres, store_for
from llmgw.store.protocol import Store
from llmgw.store.records import ControllerSeen
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

CHECK_IN_EVERY = 2.0  # seconds between a controller's check-ins on a shared store


class Controller:
    """Owns the control plane's parts; ``start()`` brings them up in order, ``close()`` down."""

    def __init__(
        self,
        config: ControllerConfig,
        *,
        sink: EndpointSink | None = None,
        usage: UsageSource | None = None,
        dispatcher: AgentVerbs | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        advertise: str | None = None,
        lease: LeadershipConfig | None = None,
    ) -> None:
        self.config = config
        # The admin URL routers and operators are sent to while this controller leads (a standby's
        # answers name the leader's); the lease's timing when the store is shared.
        self.advertise = advertise
        self.lease_config = lease or config.leadership
        self.leadership: Leadership | None = None  # made by start() for a shared (PostgreSQL) store
        self._lease_store: Store | None = None
        # The controllers on the shared store as the last check-in saw them (CHECK_IN_EVERY).
        self.peers: list[ControllerSeen] = []
        self.statuses: CommitStatuses | None = None
        self._check_ins: asyncio.Task[None] | None = None
        self._fleet_open = False
        self._quiet = False  # quiesce() ran: a lease taken from now on starts nothing
        self._led = False  # this process led once: a new lead gets a fresh reconciler
        self._handed_over = False  # hand_over() ran: stopping, it leads no more
        self.role_listeners: list[Callable[[], None]] = []  # told when this controller leads or stops
        self.registry = registry or CollectorRegistry()
        data = Path(config.data_dir)
        # SQLite in the data dir unless the config names another store (PostgreSQL: several controllers).
        self.store: Store = store_for(config.store, data)
        self.desired = DesiredState()
        # Every change this controller sends carries its lease on the node (DESIGN §4, fencing);
        # the holder id is read from the store at start.
        self.fleet = FencedDispatcher(dispatcher or FleetDispatcher(
            ssh_key=config.ssh_key, known_hosts=config.known_hosts, local_agent_config=config.local_agent_config),
            holder="")
        self.fleet.may_act = lambda: self.leading
        self.inventory = LiveInventory(self.fleet, self.store)
        self._sink, self._usage, self._clock = sink, usage, clock
        self.reconciler = self._make_reconciler()
        url = normalise_url(config.repo)
        local = Path(url.removeprefix("file://")) if "://" not in url or url.startswith("file://") else None
        watch = local if config.watch and local is not None and local.exists() else None
        self.follower = GitOpsFollower(
            GitMirror(url, config.branch, data / "mirror.git", subdir=config.subdir), self.desired, self.store,
            interval=config.fetch_interval, judge=self._judge_prune, watch_path=watch,
            registry=self.registry,
        )
        self.writer = CommitWriter(url, config.branch, data / "writer", subdir=config.subdir)
        # API keys beside the config's (`llmgw keys`): set by the serving process, which owns the router.
        self.keys: KeyBook | None = None
        self.budgets: BudgetBook | None = None  # what each budget used this period (set with the keys)
        self.router_credentials: RouterCredentials | None = None  # set with the keys, by the serving process
        self.router_reports: Callable[[], dict[str, Any]] | None = None
        self.transports = tuple(config.transports)
        self.ops = FleetOps(self)
        self._own_lock = False  # start() took the data dir's lock itself (an embedding, a test)
        self.registry.register(FleetCollector(self.ops))
        self.registry.register(LeadershipCollector(self.leadership_view))
        self.registry.register(HealthCollector(self.health))
        self._watched: list[Tracker] = []  # loops the serving process runs beside (the usage flush)
        self.warners: list[Callable[[], list[str]]] = []  # parts beside it with something to say in status

    def watch(self, tracker: Tracker) -> None:
        """Show ``tracker``'s loop in this controller's health (a loop built beside it)."""
        self._watched.append(tracker)

    def health(self) -> Health:
        """Every loop of this controller as it fares now (status, the admin API, /metrics)."""
        lease = [self.leadership.health] if self.leadership is not None else []
        return Health.of([*lease, self.follower.health, self.desired.health, self.reconciler.health, *self._watched])

    def _make_reconciler(self) -> Reconciler:
        config = self.config
        reconciler = Reconciler(self.desired, self.inventory, self.fleet, self.store, sink=self._sink,
                                usage=self._usage, config=config.reconciler,
                                manages=lambda n: n.transport in config.transports, clock=self._clock)
        reconciler.may_act = lambda: self.leading
        return reconciler

    # --- leading (DESIGN §5) --------------------------------------------------------------------
    @property
    def leading(self) -> bool:
        """This controller may act on the fleet: alone on its store, or holding the lease in time
        (and not handed over for a clean stop)."""
        return not self._handed_over and (self.leadership is None or self.leadership.leading)

    @property
    def leader_url(self) -> str | None:
        """The leader's advertised admin URL as known here (this controller's own when it leads)."""
        if self._handed_over:
            return None  # stopping: not this one, and the one it knew of was itself
        return self.advertise if self.leadership is None else self.leadership.leader_url

    def leadership_view(self) -> dict[str, Any]:
        """Role, the leader's id and URL, the epoch and the last takeover (database clock), for the
        summary, `llmgw status` and /metrics. Reads no store: the lease loop's last reading."""
        if self.leadership is None:
            return {"role": LEADER, "shared": False, "holder": self.controller_id, "leader": self.controller_id,
                    "leader_url": self.advertise, "epoch": None, "last_takeover": None}
        return {**self.leadership.summary(), "shared": True, "controllers": [c.to_json() for c in self.peers]}

    async def _check_in(self) -> None:
        """Say in the store, every CHECK_IN_EVERY seconds, that this controller is here and in which
        role; keep what the others said (an operator's view of the standbys: is one still there?)."""
        assert self.leadership is not None
        while True:
            try:
                self.peers = await asyncio.wait_for(asyncio.to_thread(
                    self.store.check_in, self.leadership.holder, url=self.advertise, role=self.leadership.role),
                    timeout=CHECK_IN_EVERY * 5)
            except (StoreError, TimeoutError) as exc:
                log.warning("could not check in on the store: %s", exc)
            await asyncio.sleep(CHECK_IN_EVERY)

    async def _lead(self, epoch: int) -> None:
        if self._quiet:
            return
        if self._led:  # the last one was closed mid-flight: start from the store's records again
            self.reconciler = self._make_reconciler()
        self._led = True
        self.reconciler.holder = self.fleet.holder
        # The store's epoch is this leader's term on the nodes: they hand it the old leader's
        # leases at once (same node epoch: its engines are adopted) and refuse the old leader.
        self.fleet.term = epoch
        log.warning("this controller leads (epoch %d): reconciling", epoch)
        await self._open_fleet()
        await self.reconciler.start()
        await self.follower.start()
        await self._statuses_start()
        self.reconciler.notify()
        self._role_changed()
        holder = self.leadership.holder if self.leadership is not None else self.controller_id
        try:
            self.store.add_event("leader", holder, f"controller {holder} leads at epoch {epoch}")
        except StoreError as exc:
            log.warning("could not record the takeover: %s", exc)

    async def _stand_by(self) -> None:
        """Stop acting at once: the reconciler first (no more node commands), then the nodes' leases."""
        log.warning("this controller no longer leads: standing by")
        self.fleet.term = None  # nothing more goes out at the term that ended
        await self.reconciler.close()
        self._role_changed()
        await self._statuses_close()
        await self.follower.close()
        await self._close_fleet()

    async def _statuses_start(self) -> None:
        """Commit statuses on the git host (config.commit_status), posted by the leader only."""
        config = self.config.commit_status
        if config is None or self.statuses is not None:
            return
        self.statuses = CommitStatuses(
            config, controller=lambda: self.controller_id, sync=lambda: self.follower.status,
            rollouts=lambda: [rec.rollout for rec in self.reconciler.rollouts.records.values() if rec.rollout])
        await self.statuses.start()

    async def _statuses_close(self) -> None:
        statuses, self.statuses = self.statuses, None
        if statuses is not None:
            await statuses.close()

    def standing_by(self) -> tuple[bool, str | None]:
        """(this controller stands by, the leader's admin URL as known): the feed's question."""
        return not self.leading, self.leader_url

    def _role_changed(self) -> None:
        for listener in self.role_listeners:
            listener()

    async def _open_fleet(self) -> None:
        if not self._fleet_open:
            await self.fleet.open()
            self._fleet_open = True

    async def _close_fleet(self) -> None:
        """A clean stop gives the nodes back at once (their engines keep running): a controller
        started next, this one again or another, need not wait the leases out."""
        if self._fleet_open:
            self._fleet_open = False
            try:
                await self.fleet.release()
            finally:
                await self.fleet.close()

    def _judge_prune(self, old: Catalog | None, new: Catalog) -> PruneVerdict:
        """The guard on the live fleet: the ready replicas ``new`` would stop, by decide()."""
        return judge_prune(old, new, self.inventory.snapshot(), tuple(self.reconciler.snapshot()), now=time.time(),
                           last_used=self.reconciler.usage.last_used())

    @property
    def controller_id(self) -> str:
        return self.fleet.holder

    def _holder_id(self) -> str:
        """This controller's name on the nodes' leases: made once per data dir and kept as it is
        (an id from an older version too), so a restart after a crash, a new hostname or another
        path to the same data dir is the same controller: it renews its own leases and adopts its
        engines (a name that changed with its environment fenced a controller off its own fleet).

        A copy of the data dir (a restored backup, one started by mistake) has this id too; the
        instance nonce the fenced dispatcher makes per process tells the two apart on the nodes."""
        cid = self.store.controller_id()
        if not cid:
            cid = f"{socket.gethostname()}-{secrets.token_hex(4)}"
            self.store.set_controller_id(cid)
        return cid

    async def takeover(self, node_id: str, *, stop_foreign: bool = False) -> dict[str, Any]:
        """Take ``node_id``'s lease from whichever controller holds it (an operator's decision).

        Engines the other controller started keep running and are reported, unless
        ``stop_foreign``: then they are stopped, as the operator asked, not silently.
        """
        if self.fleet.epoch(node_id) is not None and not stop_foreign:
            # Already ours: raising the epoch would only make our own commands in flight stale.
            return {"node": node_id, "holder": self.controller_id, "epoch": self.fleet.epoch(node_id),
                    "stopped": [], "already": True}
        lease = await self.fleet.takeover(node_id)
        self.store.add_event("node-takeover", node_id, f"this controller ({self.controller_id}) took over "
                                                       f"node {node_id} (epoch {lease['epoch']})")
        await self.inventory.poll()
        stopped = []
        node = self.inventory.snapshot().node(node_id)
        lifecycle = self.reconciler.lifecycle
        if stop_foreign and node is not None and node.report is not None and lifecycle is not None:
            claimed = {s.agent_id for r in self.reconciler.snapshot() for s in r.shards if s.node == node_id}
            held = node.report.lease
            for e in node.report.engines:
                # After the takeover every engine started before it (another controller's, a copy
                # of our data dir's) is stamped with an older lease: not ours, so stopped as asked.
                if (e.alive and e.replica_id not in claimed
                        and not engine_is_ours(e, held, holder=self.controller_id)):
                    if await lifecycle.stop_engine(node_id, e.replica_id):
                        stopped.append(e.replica_id)
                        self.store.add_event("foreign-engine-stopped", e.replica_id,
                                             f"engine {e.replica_id} on {node_id} (started by {e.holder}) stopped "
                                             "at takeover, as asked")
        self.reconciler.notify()
        return {"node": node_id, "holder": self.controller_id, "epoch": lease["epoch"], "stopped": stopped,
                "already": False}

    async def start(self) -> None:
        # One process per data dir (the command line took it already; an embedding had not). With
        # the lock held, the instance that ran here before has ended: name it to the nodes.
        self._own_lock = not held_here(self.config.data_dir)
        hold_data_dir(self.config.data_dir)
        self.fleet.predecessor = succeed(self.config.data_dir, self.fleet.instance)
        self.store.open()
        log.info("store: %s", self.store.where)  # redacted: a URL's password is not shown
        self.fleet.holder = self.reconciler.holder = self._holder_id()
        if is_postgres(self.config.store):
            # Shared store: stand by until the lease is ours. The follower runs only while leading:
            # two followers on one store race each other's records (a standby that restored before
            # the leader applied held the leader's own revision for confirmation, in the store
            # both read), and a standby's prune guard would judge against a fleet it does not see.
            self._lease_store = store_for(self.config.store, Path(self.config.data_dir)).open()
            self.leadership = Leadership(self._lease_store, url=self.advertise, on_lead=self._lead,
                                         on_standby=self._stand_by, config=self.lease_config)
            self.desired.subscribe(self._on_catalog, order=RECONCILER)
            await self.leadership.start()
            self._check_ins = asyncio.create_task(self._check_in(), name="llmgw-check-in")
            return
        await self._open_fleet()
        await self.reconciler.start()
        self.desired.subscribe(self._on_catalog, order=RECONCILER)
        await self.follower.start()
        await self._statuses_start()

    async def quiesce(self) -> None:
        """Stop following git and reconciling: from here on nothing is started or stopped."""
        self._quiet = True
        await self._statuses_close()
        await self.follower.close()
        await self.reconciler.close()

    async def hand_over(self) -> None:
        """A clean stop, once nothing reconciles: the nodes' leases and the lead go back at once,
        and the routers' watches here end, so they follow whoever leads next (the admin API goes
        on answering, as a standby, until the process ends)."""
        await self._statuses_close()
        await self._close_fleet()
        self._handed_over = True
        if self.leadership is not None:
            await self.leadership.close()
        self._role_changed()

    async def stop_engines(self) -> None:
        """Stop every engine this controller runs (for `up`, whose engines end with it)."""
        await self.reconciler.stop_all()

    async def close(self) -> None:
        await self.quiesce()
        await self._close_fleet()
        await cancel_and_wait(self._check_ins)
        if self.leadership is not None:  # after the last node command: a standby takes over at once
            await self.leadership.close()
        if self._lease_store is not None:
            self._lease_store.close()
        self.store.close()
        if self._own_lock:  # taken here, not by the command line (whose process is ending anyway)
            release_data_dir(self.config.data_dir)

    def _on_catalog(self, catalog: Catalog) -> None:  # noqa: ARG002 - the reconciler reads it itself
        self.reconciler.notify()
