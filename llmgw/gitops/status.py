"""What the controller says about its sync with git: status, rejections, pending prunes.

The records the store keeps (a rejection, a held prune, a rewrite of history) are defined below
the store, in :mod:`llmgw.store.records`, and named here too for gitops' own use.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from llmgw.redact import redact
from llmgw.store.records import History, PendingPrune, Rejection, Rewrite

__all__ = ["History", "PendingPrune", "Rejection", "Rewrite", "SyncState", "SyncStatus"]


class SyncState(str, Enum):
    PENDING = "pending"  # nothing applied yet (first fetch not done or not valid)
    SYNCED = "synced"
    REJECTED = "rejected"
    NEEDS_CONFIRMATION = "needs-confirmation"
    FETCH_FAILED = "fetch-failed"
    BRANCH_MISSING = "branch-missing"  # the followed branch is gone from the remote; the last good state stays


@dataclass(frozen=True)
class SyncStatus:
    state: SyncState = SyncState.PENDING
    applied_sha: str | None = None
    applied_at: float | None = None
    head_sha: str | None = None
    fetched_at: float | None = None
    last_error: str | None = None
    rejected: Rejection | None = None
    pending: PendingPrune | None = None
    rewrite: Rewrite | None = None
    branch: str = ""
    url: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "url": redact(self.url),  # redacted already; again here, where every reader of the status passes
            "branch": self.branch,
            "applied_sha": self.applied_sha,
            "applied_at": self.applied_at,
            "head_sha": self.head_sha,
            "fetched_at": self.fetched_at,
            "last_error": redact(self.last_error) if self.last_error else self.last_error,
            "rejected": self.rejected.to_json() if self.rejected else None,
            "pending_confirmation": self.pending.to_json() if self.pending else None,
            "last_rewrite": self.rewrite.to_json() if self.rewrite else None,
        }
