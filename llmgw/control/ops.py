"""What the operator's surfaces may ask of a controller: the admin API, the dashboard, the fleet
metrics. They used to reach through `Controller` into its parts (``c.inventory…``,
``c.reconciler…``, ``c.store…``, dozens of places), so renaming a part broke the admin API; now
they see this façade only, and the parts are the controller's own business.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from llmgw.catalog import Catalog, RawFile
from llmgw.catalog.keys import tenants_without_keys
from llmgw.contract import PromptCache
from llmgw.control.keys import KeyBook, KeyRefused, Made, tenants_overruled
from llmgw.control.orphans import Orphan, collect
from llmgw.control.router_credentials import MadeCredential, RouterCredentials
from llmgw.control.usage import BudgetBook
from llmgw.decide.replica import Replica
from llmgw.gitops.gitcli import read_tree
from llmgw.gitops.status import SyncStatus
from llmgw.health import Health
from llmgw.inventory import Inventory, NodeState
from llmgw.plan import FleetSnapshot
from llmgw.store.audit import AuditEntry, AuditRecord, Verdict, verify
from llmgw.store.protocol import Store
from llmgw.store.records import Event

if TYPE_CHECKING:
    from llmgw.dispatch.fence import FencedDispatcher
    from llmgw.gitops import DesiredState, GitOpsFollower
    from llmgw.gitops.writer import CommitWriter
    from llmgw.reconciler.live import LiveInventory
    from llmgw.reconciler.reconciler import Reconciler
    from llmgw.reconciler.rollouts import RolloutDriver


class ControlPlane(Protocol):
    """The parts of a controller the façade reads and drives (`llmgw.control.controller.Controller`
    is one): typed by what is used, so the façade does not import the controller that builds it."""

    desired: DesiredState
    follower: GitOpsFollower
    inventory: LiveInventory
    reconciler: Reconciler
    store: Store
    writer: CommitWriter
    keys: KeyBook | None
    router_credentials: RouterCredentials | None
    router_reports: Callable[[], dict[str, Any]] | None  # per router: what its last report moves
    warners: list[Callable[[], list[str]]]
    budgets: BudgetBook | None
    transports: tuple[str, ...]  # the node transports it drives
    fleet: FencedDispatcher
    registry: CollectorRegistry

    @property
    def controller_id(self) -> str: ...

    async def takeover(self, node_id: str, *, stop_foreign: bool = False) -> dict[str, Any]: ...

    def leadership_view(self) -> dict[str, Any]: ...

    def standing_by(self) -> tuple[bool, str | None]: ...

    def health(self) -> Health: ...


class FleetOps:
    def __init__(self, controller: ControlPlane) -> None:
        self._c = controller

    # --- reading ----------------------------------------------------------------------------
    def leadership(self) -> dict[str, Any]:
        """This controller's role (leader/standby), the leader's id and URL, the epoch, the last takeover."""
        return self._c.leadership_view()

    def standing_by(self) -> tuple[bool, str | None]:
        """(another controller leads, its advertised admin URL as known here)."""
        return self._c.standing_by()

    @property
    def catalog(self) -> Catalog | None:
        return self._c.desired.catalog

    @property
    def sync_status(self) -> SyncStatus:
        return self._c.follower.status

    @property
    def controller_id(self) -> str:
        return self._c.controller_id

    def inventory(self) -> Inventory:
        return self._c.inventory.snapshot()

    def replicas(self) -> list[Replica]:
        return self._c.reconciler.snapshot()

    def unplaced(self) -> Mapping[str, int]:
        return self._c.reconciler.last_decisions.unplaced

    def fetches(self) -> Mapping[str, Mapping[str, Mapping[str, object]]]:
        """Per fetching replica, per node: the source read and how far (llmgw.reconciler.lifecycle)."""
        lifecycle = self._c.reconciler.lifecycle
        return {} if lifecycle is None else dict(lifecycle.fetches)

    def unconfirmed_demand(self) -> Mapping[str, int]:
        """Per model, in-flight requests routers reported that its engines did not count."""
        return self._c.reconciler.unconfirmed_demand

    def drain_waits(self) -> dict[str, list[str]]:
        """Per draining node: what its drain waits for, in words."""
        out: dict[str, list[str]] = {}
        reps = {r.id: r for r in self.replicas()}
        for rid, why in self._c.reconciler.last_decisions.drain_waits.items():
            for node in sorted(set(reps[rid].nodes)) if rid in reps else ():
                out.setdefault(node, []).append(f"waits for replica {rid}: {why}")
        return out

    def last_used(self) -> Mapping[str, float]:
        return self._c.reconciler.usage.last_used()

    def prompt_cache(self) -> Mapping[str, PromptCache]:
        return self._c.reconciler.usage.prompt_cache()

    def engine_queue(self) -> Mapping[str, tuple[int, int]]:
        return self._c.reconciler.usage.engine_queue()

    def snapshot(self) -> FleetSnapshot:
        """The fleet as `llmgw inventory export` writes it (the input of a plan)."""
        records = self._c.reconciler.rollouts.records.values()
        book = self._c.keys
        return FleetSnapshot(self.inventory(), tuple(self.replicas()), time.time(),
                             tuple(rec.rollout for rec in records if rec.rollout is not None),
                             self._c.transports, tuple(sorted(book.names())) if book is not None else None)

    def events(self, *, after: int = 0, limit: int = 200) -> list[Event]:
        return self._c.store.events(after=after, limit=limit)

    def usage(self, since: float, until: float, *, by: tuple[str, ...], step: int = 0,
              where: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """The ledger's sums over [since, until) (every router's usage, as recorded so far)."""
        return self._c.store.usage(since, until, by=by, step=step, where=dict(where or {}))

    # --- the catalog's history --------------------------------------------------------------
    async def has_revision(self, rev: str) -> bool:
        return await asyncio.to_thread(self._c.follower.mirror.has, rev)

    async def read_revision(self, rev: str) -> dict[str, RawFile]:
        """The catalog files of a revision the controller has fetched."""
        mirror = self._c.follower.mirror
        return await asyncio.to_thread(read_tree, mirror.path, rev, subdir=mirror.subdir)

    # --- acting -----------------------------------------------------------------------------
    async def poll(self) -> Inventory:
        """Ask every node now (e.g. before judging what to delete)."""
        return await self._c.inventory.poll()

    # --- rollouts (llmgw.reconciler.rollouts) ------------------------------------------------
    def rollouts(self) -> list[dict[str, Any]]:
        """Every model's last rollout (phase, step, canary share, the last analysis)."""
        return self._c.reconciler.rollouts.status()

    def rollout(self, model: str) -> dict[str, Any] | None:
        return next((r for r in self.rollouts() if r["model"] == model), None)

    def rollout_promote(self, model: str, actor: str) -> dict[str, Any]:
        """Promote ``model``'s canary (or its rolled-back version) now; RolloutError when there is
        nothing to promote."""
        return self._rollout_act(model, lambda d: d.promote(model, actor))

    def rollout_abort(self, model: str, actor: str) -> dict[str, Any]:
        """Stop ``model``'s rollout in progress; RolloutError when there is none."""
        return self._rollout_act(model, lambda d: d.abort(model, actor))

    def _rollout_act(self, model: str, act: Callable[[RolloutDriver], object]) -> dict[str, Any]:
        # Synchronous on the controller's loop, as cordon and drain are: a tick changes the records
        # only between its awaits, from planning to noting what it decided, with no await in that
        # stretch, so an operator's change lands before or after it, never inside. Saved at once
        # (a controller killed before its next tick still remembers it), then the tick acts on it.
        driver = self._c.reconciler.rollouts
        act(driver)
        driver.save()
        self._c.reconciler.notify()
        shown = self.rollout(model)
        assert shown is not None  # the action left a rollout record
        return shown

    def set_node_state(self, node_id: str, state: NodeState) -> None:
        """Cordon, drain or uncordon; the reconciler acts on it at once. KeyError for an unknown node."""
        self._c.inventory.set_operator_state(node_id, state)
        self._c.reconciler.notify()

    async def sync(self, *, confirm: bool = False) -> SyncStatus:
        """Fetch now, or apply the commit the prune guard holds (LlmgwError when none is held)."""
        return await (self._c.follower.confirm() if confirm else self._c.follower.sync_once())

    def trigger_sync(self) -> None:
        self._c.follower.trigger()

    def add_model(self, definition: Any, actor: str) -> str:
        """Commit and push the model; the commit's sha."""
        return self._c.writer.add_model(definition, actor)

    def remove_model(self, name: str, actor: str) -> str:
        return self._c.writer.remove_model(name, actor)

    # --- API keys (`llmgw keys`) -------------------------------------------------------------
    def _keys(self) -> KeyBook:
        if self._c.keys is None:
            raise KeyRefused("this controller serves no router: API keys are made where one is served "
                            "(`llmgw controller` or `llmgw up`)")
        return self._c.keys

    def keys(self) -> list[dict[str, Any]]:
        return self._keys().listing()

    def create_key(self, name: str, models: Sequence[str], actor: str, tenant: str | None = None) -> Made:
        made = self._keys().create(name, models, tenant)
        whose = f", tenant {tenant}" if tenant else ""
        self._c.store.add_event("key-created", name, f"API key {name} made by {actor} for models "
                                                     f"{', '.join(made.models)}{whose}")
        return made

    def revoke_key(self, name: str, actor: str) -> None:
        self._keys().revoke(name)
        self._c.store.add_event("key-revoked", name, f"API key {name} revoked by {actor}")

    def _routers(self) -> RouterCredentials:
        if self._c.router_credentials is None:
            raise KeyRefused("this controller serves no router feed: router credentials are made where one is "
                             "served (`llmgw controller` or `llmgw up`)")
        return self._c.router_credentials

    def routers(self) -> list[dict[str, Any]]:
        """Each router credential, with what its router's last report moves (llmgw.control.feed)."""
        creds = self._routers()
        creds.reload()
        reports = self._c.router_reports() if self._c.router_reports is not None else {}
        return [{**c, "report": reports.get(c["name"])} for c in creds.listing()]

    def create_router(self, name: str, actor: str) -> MadeCredential:
        made = self._routers().create(name)
        self._c.store.add_event("router-credential-created", name, f"router credential {name} made by {actor}")
        return made

    def revoke_router(self, name: str, actor: str) -> None:
        self._routers().revoke(name)
        self._c.store.add_event("router-credential-revoked", name, f"router credential {name} revoked by {actor}")

    # --- the audit trail --------------------------------------------------------------------
    async def audit(self, *, who: str, role: str, source: str, action: str, result: str) -> None:
        """Append one row to the audit chain, with the applied revision and the time (in a thread:
        the store blocks)."""
        entry = AuditEntry(time.time(), who, role, source, action, result, self._c.follower.status.applied_sha or "")
        await asyncio.to_thread(self._c.store.append_audit, entry)

    def audit_rows(self, *, since: float = 0.0, after: int = 0, limit: int = 0, last: int = 0) -> list[AuditRecord]:
        return self._c.store.audit(since=since, after=after, limit=limit, last=last)

    def audit_verify(self) -> Verdict:
        """The whole chain recomputed (llmgw.store.audit.verify)."""
        return verify(self._c.store.audit())

    def budgets(self) -> list[dict[str, Any]]:
        """Each tenant budget: size, used this period, left, when it resets (none: no router here)."""
        return self._c.budgets.view() if self._c.budgets is not None else []

    def health(self) -> Health:
        """How each of the controller's loops fares: a tick or a sync that keeps failing shows here."""
        return self._c.health()

    def warnings(self) -> list[str]:
        """What status says is wrong though the controller runs: key warnings, a catalog that did
        not reach every part, a loop that is failing."""
        return self.key_warnings() + self.health().problems() + [w for fn in self._c.warners for w in fn()]

    def key_warnings(self) -> list[str]:
        """Tenants naming keys no API key has, keys made for a tenant the catalog overrules (status,
        the dashboard, an event once per catalog)."""
        book = self._c.keys
        if book is None:
            return []
        return tenants_without_keys(self.catalog, book.names()) + tenants_overruled(self.catalog, book.listing())

    @property
    def registry(self) -> CollectorRegistry:
        return self._c.registry

    async def collect(self, orphans: list[Orphan]) -> dict[str, Any]:
        """Ask the nodes to delete ``orphans`` (each node's guard decides); recorded as an event."""
        result = await collect(self._c.fleet, orphans)
        self._c.store.add_event("weights-collected", "weights", result["summary"])
        await self._c.inventory.poll()
        return result

    async def takeover(self, node_id: str, *, stop_foreign: bool = False) -> dict[str, Any]:
        return await self._c.takeover(node_id, stop_foreign=stop_foreign)
