"""The control plane wired together: git → desired state → reconciler → nodes → router.

This is the one place that knows every part; each part knows only the narrow interfaces
it is given (the endpoint sink and the usage source toward the router, the dispatcher
toward the nodes), so the router can run in another process and nothing here changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from llmgw.catalog import Catalog
from llmgw.control.config import ControllerConfig
from llmgw.control.fleet_dispatch import FleetDispatcher
from llmgw.dispatch.base import Dispatcher
from llmgw.gitops import DesiredState, GitMirror, GitOpsFollower, Store
from llmgw.gitops.desired import RECONCILER
from llmgw.gitops.repo import normalise_url
from llmgw.gitops.writer import CommitWriter
from llmgw.inventory.live import LiveInventory
from llmgw.plan.guard import PruneVerdict, judge_prune
from llmgw.reconciler import EndpointSink, Reconciler, UsageSource

log = logging.getLogger(__name__)


class Controller:
    """Owns the control plane's parts; ``start()`` brings them up in order, ``close()`` down."""

    def __init__(
        self,
        config: ControllerConfig,
        *,
        sink: EndpointSink | None = None,
        usage: UsageSource | None = None,
        dispatcher: Dispatcher | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        data = Path(config.data_dir)
        self.store = Store(data / "llmgw.db")
        self.desired = DesiredState()
        self.fleet = dispatcher or FleetDispatcher(
            ssh_key=config.ssh_key, known_hosts=config.known_hosts, local_agent_config=config.local_agent_config)
        self.inventory = LiveInventory(self.fleet, self.store)
        self.reconciler = Reconciler(self.desired, self.inventory, self.fleet, self.store, sink=sink, usage=usage,
                                     config=config.reconciler, manages=lambda n: n.transport in config.transports,
                                     clock=clock)
        url = normalise_url(config.repo)
        watch = Path(url) if config.watch and Path(url).exists() else None
        self.follower = GitOpsFollower(
            GitMirror(url, config.branch, data / "mirror.git", subdir=config.subdir), self.desired, self.store,
            interval=config.fetch_interval, judge=self._judge_prune, watch_path=watch,
            registry=self.registry,
        )
        self.writer = CommitWriter(url, config.branch, data / "writer", subdir=config.subdir)
        from llmgw.admin.fleet_metrics import FleetCollector

        self.registry.register(FleetCollector(self))

    def _judge_prune(self, old: Catalog | None, new: Catalog) -> PruneVerdict:
        """The guard on the live fleet: the ready replicas ``new`` would stop, by decide()."""
        return judge_prune(old, new, self.inventory.snapshot(), tuple(self.reconciler.snapshot()), now=time.time())

    async def start(self) -> None:
        self.store.open()
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
        await self.fleet.close()
        self.store.close()

    def _on_catalog(self, catalog: Catalog) -> None:  # noqa: ARG002 - the reconciler reads it itself
        self.reconciler.notify()
