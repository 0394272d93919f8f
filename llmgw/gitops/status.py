"""What the controller says about its sync with git: status, rejections, pending prunes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from llmgw.catalog import Problem
from llmgw.redact import redact


class SyncState(str, Enum):
    PENDING = "pending"  # nothing applied yet (first fetch not done or not valid)
    SYNCED = "synced"
    REJECTED = "rejected"
    NEEDS_CONFIRMATION = "needs-confirmation"
    FETCH_FAILED = "fetch-failed"
    BRANCH_MISSING = "branch-missing"  # the followed branch is gone from the remote; the last good state stays


class History(str, Enum):
    """How a fetched head relates to the one fetched before it."""

    FORWARD = "forward"        # the old head is an ancestor of the new: ordinary commits
    REWIND = "rewind"          # the new head is an ancestor of the old: a reset to an older commit
    FORCE_PUSH = "force-push"  # neither: history was rewritten (an amend, a rebase, an orphan branch)


@dataclass(frozen=True)
class Rewrite:
    """The last time the followed branch's history went back or was rewritten."""

    kind: History
    from_sha: str
    to_sha: str
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "from_sha": self.from_sha, "to_sha": self.to_sha, "time": self.time}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Rewrite:
        return cls(History(d["kind"]), d["from_sha"], d["to_sha"], d["time"])

    def describe(self) -> str:
        what = "rewound" if self.kind == History.REWIND else "force-pushed (history rewritten)"
        return f"{what} from {self.from_sha[:12]} to {self.to_sha[:12]}"


@dataclass(frozen=True)
class Rejection:
    sha: str
    author: str
    subject: str
    time: float
    problems: tuple[Problem, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "sha": self.sha,
            "author": self.author,
            "subject": self.subject,
            "time": self.time,
            "problems": [p.to_json() for p in self.problems],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Rejection:
        return cls(d["sha"], d["author"], d["subject"], d["time"], tuple(Problem(**p) for p in d["problems"]))


@dataclass(frozen=True)
class PendingPrune:
    sha: str
    author: str
    subject: str
    reasons: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"sha": self.sha, "author": self.author, "subject": self.subject, "reasons": list(self.reasons)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PendingPrune:
        return cls(d["sha"], d["author"], d["subject"], tuple(d["reasons"]))


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
