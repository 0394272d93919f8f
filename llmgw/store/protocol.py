"""The controller's store as its parts see it: one Protocol, two implementations.

:class:`llmgw.store.sqlite.SqliteStore` keeps the state in the data dir (the embedded default,
one controller); :class:`llmgw.store.postgres.PostgresStore` in a PostgreSQL database several
controllers share, one leading by the lease below (DESIGN §5 "High availability"). The
follower, the reconciler and the admin façade are typed by this Protocol and never import an
implementation (an import-linter contract keeps it so); :func:`llmgw.store.opening.store_for`
picks one from the controller config's ``store``.

What every method may be relied on for, whichever store:

- A read returns what the last write stored, records equal to the ones written.
- A ``save_*`` replaces the whole set in one transaction; a ``set_*`` of None forgets the record.
- A call that fails raises :class:`llmgw.errors.StoreError` (the database away, a timeout, a
  full disk), never a driver's own error; nothing is half-written. ``open()`` raises
  :class:`llmgw.errors.ConfigError` when the store cannot be used at all (unreachable, made by a
  newer llmgw), naming the store without its password.
- Calls are safe from several threads (the controller calls from its event loop and from
  worker threads); each is bounded in time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, Self

from llmgw.contract import UsageBatch
from llmgw.decide.replica import Replica
from llmgw.store.audit import AuditEntry, AuditRecord
from llmgw.store.records import (
    Applied,
    ControllerSeen,
    Event,
    Leadership,
    LeaseGrant,
    PendingPrune,
    Rejection,
    Rewrite,
)

USAGE_GROUPS = ("tenant", "key", "model")


class Store(Protocol):
    """The controller's durable state (see the module)."""

    @property
    def where(self) -> str:
        """The store as an operator may be shown it: a path, or a URL without its password."""

    def open(self) -> Self:
        """Connect and bring the schema up to date (idempotent); returns the store."""

    def close(self) -> None: ...

    # --- the GitOps follower's memory ------------------------------------------------------
    def applied(self) -> Applied | None: ...

    def set_applied(self, applied: Applied) -> None: ...

    def pending(self) -> PendingPrune | None: ...

    def set_pending(self, pending: PendingPrune | None) -> None: ...

    def rejected(self) -> Rejection | None: ...

    def set_rejected(self, rejection: Rejection | None) -> None: ...

    def judged(self) -> str | None:
        """The head last judged, so a bad commit is judged (and reported) once."""

    def set_judged(self, sha: str | None) -> None: ...

    def rewrite(self) -> Rewrite | None: ...

    def set_rewrite(self, rewrite: Rewrite | None) -> None: ...

    def weight_digests(self) -> dict[str, str]:
        """Per cache entry, the digest of its chunk list as a node read it from the origin (what a
        node reading the entry from a peer checks the peer's list against, kept across restarts and
        leaders: without it one node read the origin again)."""

    def set_weight_digests(self, digests: Mapping[str, str]) -> None: ...

    def usage_gate_state(self) -> Any:
        """The usage gate's figures (llmgw.control.usage.GatedLedger), as last kept; None: none."""

    def set_usage_gate_state(self, state: Any) -> None: ...

    # --- the reconciler's memory -----------------------------------------------------------
    def append_audit(self, entry: AuditEntry) -> AuditRecord:
        """Append ``entry`` to the audit chain (llmgw.store.audit); there is no call to change a row."""
        ...

    def audit(self, *, since: float = 0.0, after: int = 0, limit: int = 0, last: int = 0) -> list[AuditRecord]:
        """The audit rows from ``since`` and after id ``after``, oldest first (limit 0: all; ``last``:
        only the newest that many)."""
        ...

    def api_keys(self) -> list[dict[str, Any]]:
        """Keys made by `llmgw keys create`: ``{name, sha256, models, created_at}`` (never the key)."""
        ...

    def add_api_key(self, entry: Mapping[str, Any]) -> bool:
        """False when a key of that name exists (nothing is changed)."""
        ...

    def replace_api_key(self, name: str, entry: Mapping[str, Any]) -> bool:
        """``name``'s record replaced by ``entry`` (a revoked key's tombstone), in one transaction;
        False when there is no ``name``."""
        ...

    def replicas(self) -> list[Replica]:
        """The replica records, by id."""

    def save_replicas(self, replicas: Iterable[Replica]) -> None: ...

    def rollout_records(self) -> dict[str, dict[str, Any]]:
        """Per model: its rollout record (llmgw.reconciler.rollouts); a row that is not JSON is left out."""

    def save_rollout_records(self, records: Mapping[str, Mapping[str, Any]]) -> None: ...

    def generation(self) -> int:
        """The highest replica generation issued so far (0: none yet)."""

    def next_generation(self, *, above: int = 0) -> int:
        """The next replica generation, past ``above`` too: generations only grow (atomic, so two
        callers never get the same one)."""

    # --- operators' decisions and this controller's name -----------------------------------
    def node_states(self) -> dict[str, str]: ...

    def set_node_state(self, node: str, state: str | None) -> None:
        """An operator state (cordoned, draining), or None for ready."""

    def controller_id(self) -> str | None: ...

    def set_controller_id(self, cid: str) -> None: ...

    # --- the event log ---------------------------------------------------------------------
    def add_event(self, kind: str, subject: str, message: str, *, now: float | None = None) -> Event:
        """Stored redacted (llmgw.redact); the event as stored, with its id."""

    def events(self, *, after: int = 0, limit: int = 200) -> list[Event]:
        """Events with id > ``after``, oldest first, at most ``limit`` (the newest ones when cut)."""

    # --- the usage ledger (routers' batches, which the budget book is read from) ----------
    def record_usage(self, batch: UsageBatch, *, now: float | None = None) -> bool:
        """Add the batch's rows unless its (instance, seq) was recorded before (or a later seq of
        that instance was): True when recorded now. Rows and seq in one transaction."""

    def usage_seq(self, instance: str) -> int:
        """The last batch number recorded for a router instance (0: none)."""

    def usage(self, since: float, until: float, *, by: tuple[str, ...] = USAGE_GROUPS, step: int = 0,
              where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Sums over minutes in [since, until), grouped by ``by`` (of tenant, key, model) and, with
        ``step`` seconds, by time (each row's ``time`` is its step's start)."""

    def compact_usage(self, *, now: float | None = None) -> int:
        """Fold minutes older than a week into their hours; how many minutes were folded in."""

    # --- the leader lease (DESIGN §5) --------------------------------------------------------
    def acquire_lease(self, holder: str, *, ttl: float) -> LeaseGrant | None:
        """Lead, at a new epoch, if no one's lease is in force (never held, released, or lapsed on
        the database's clock); None otherwise, this holder's own unexpired lease included (a
        leader renews; a restarted process waits out its previous life's lease unless that one
        released it). Holder ids must be unique per process."""

    def renew_lease(self, holder: str, epoch: int, *, ttl: float) -> LeaseGrant | None:
        """Extend this holder's lease at ``epoch`` to ``ttl`` from the database's now, if it is still
        in force; None when it lapsed or was taken (then stop acting: the epoch is over)."""

    def release_lease(self, holder: str, epoch: int) -> bool:
        """Give the lease up at once (a graceful stop), so a standby's next acquire takes it; the
        epoch stays, so the next leader's is higher. False when it was not this holder's."""

    def leadership(self) -> Leadership:
        """Who leads, at which epoch, until when, since when (the database's clock)."""

    def check_in(self, holder: str, *, url: str | None, role: str) -> list[ControllerSeen]:
        """Note this controller as seen now (database clock) in ``role``, forget those not seen for
        FORGET_AFTER seconds, and return every one left, this one included, most recent first:
        how an operator sees the standbys and whether each is still there."""
