"""The control plane wired together: git → desired state → reconciler → nodes → router.

This is the one place that knows every part; each part knows only the narrow interfaces
it is given (the endpoint sink and the usage source toward the router, the dispatcher
toward the nodes), so the router can run in another process and nothing here changes.
"""

from __future__ import annotations

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
from llmgw.control.fleet_metrics import FleetCollector
from llmgw.control.ops import FleetOps
from llmgw.dispatch.base import AgentVerbs
from llmgw.dispatch.fence import FencedDispatcher
from llmgw.gitops import DesiredState, GitMirror, GitOpsFollower
from llmgw.gitops.desired import RECONCILER
from llmgw.gitops.repo import normalise_url
from llmgw.gitops.writer import CommitWriter
from llmgw.inventory import engine_is_ours
from llmgw.plan.guard import PruneVerdict, judge_prune
from llmgw.reconciler.live import LiveInventory
from llmgw.reconciler.reconciler import Reconciler
from llmgw.store.opening import store_for
from llmgw.store.protocol import Store

log = logging.getLogger(__name__)


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
    ) -> None:
        self.config = config
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
        self.inventory = LiveInventory(self.fleet, self.store)
        self.reconciler = Reconciler(self.desired, self.inventory, self.fleet, self.store, sink=sink, usage=usage,
                                     config=config.reconciler, manages=lambda n: n.transport in config.transports,
                                     clock=clock)
        url = normalise_url(config.repo)
        local = Path(url.removeprefix("file://")) if "://" not in url or url.startswith("file://") else None
        watch = local if config.watch and local is not None and local.exists() else None
        self.follower = GitOpsFollower(
            GitMirror(url, config.branch, data / "mirror.git", subdir=config.subdir), self.desired, self.store,
            interval=config.fetch_interval, judge=self._judge_prune, watch_path=watch,
            registry=self.registry,
        )
        self.writer = CommitWriter(url, config.branch, data / "writer", subdir=config.subdir)
        self.ops = FleetOps(self)
        self._own_lock = False  # start() took the data dir's lock itself (an embedding, a test)
        self.registry.register(FleetCollector(self.ops))

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
        await self.fleet.open()
        await self.reconciler.start()
        self.desired.subscribe(self._on_catalog, order=RECONCILER)
        await self.follower.start()

    async def quiesce(self) -> None:
        """Stop following git and reconciling: from here on nothing is started or stopped."""
        await self.follower.close()
        await self.reconciler.close()

    async def stop_engines(self) -> None:
        """Stop every engine this controller runs (for `up`, whose engines end with it)."""
        await self.reconciler.stop_all()

    async def close(self) -> None:
        await self.quiesce()
        # A clean stop gives the nodes back at once (their engines keep running): a controller
        # started next, this one again or another, need not wait the leases out.
        await self.fleet.release()
        await self.fleet.close()
        self.store.close()
        if self._own_lock:  # taken here, not by the command line (whose process is ending anyway)
            release_data_dir(self.config.data_dir)

    def _on_catalog(self, catalog: Catalog) -> None:  # noqa: ARG002 - the reconciler reads it itself
        self.reconciler.notify()
