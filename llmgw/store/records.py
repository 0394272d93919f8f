"""The records the controller's store keeps, as values: what the GitOps follower remembers
(applied, held, rejected, rewritten), the event log's entries, and the leader lease's answers.

They sit below the store and below gitops, so both import them and neither imports the other:
the store used to import ``llmgw.gitops.status`` for these while the follower imported the
SQLite store, an arrow each way. Pure (no I/O): ``llmgw.gitops.status`` re-exports the sync
records, and the plan or the admin API may use any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from llmgw.catalog import Problem


class SyncKind(str, Enum):
    """The follower's records, one row each: what it applied, held, rejected, judged, saw rewritten."""

    APPLIED = "applied"
    PENDING = "pending"
    REJECTED = "rejected"
    JUDGED = "judged"
    REWRITE = "rewrite"
    WEIGHTS = "weights"  # per cache entry, the digest of its chunk list as a node read it from the origin
    USAGE_GATE = "usage-gate"  # what engines counted and routers reported (llmgw.decide.usage_gate)


@dataclass(frozen=True)
class Applied:
    sha: str
    time: float
    source: str | None = None  # "<url> <branch>" it was followed from (None: written before this was kept)


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
class Event:
    id: int
    time: float
    kind: str
    subject: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "kind": self.kind, "subject": self.subject, "message": self.message}


# --- the leader lease (DESIGN §5 "High availability") ------------------------------------------
@dataclass(frozen=True)
class LeaseGrant:
    """This holder leads, at ``epoch``, until ``expires`` on the database's clock (seconds since
    the Unix epoch, as the database counts them).

    ``ttl`` is how long the database granted, counted from its own reading of the time while
    the call ran. The caller cannot compare ``expires`` with its own clock (the two clocks may
    disagree by any amount), but it can count ``ttl`` on its monotonic clock from just before
    the call: the database read its clock after that moment, so the lease lasts at least that
    long in real time. :meth:`deadline` is that count less a margin, the moment by which a
    leader that could not renew must have stopped acting: past it, another may take the lease.
    """

    epoch: int
    expires: float
    ttl: float

    def deadline(self, started: float, *, margin: float) -> float:
        """The local moment (``started``: ``time.monotonic()`` read just before the call that
        granted this) after which this holder must not act as leader unless it renewed."""
        return started + self.ttl - margin


@dataclass(frozen=True)
class ControllerSeen:
    """A controller on the store as its last check-in left it (:meth:`Store.check_in`): its holder
    id, the admin URL it advertises, its role then, and how long ago that was (database clock)."""

    holder: str
    url: str | None
    role: str
    age: float

    def to_json(self) -> dict[str, object]:
        return {"holder": self.holder, "url": self.url, "role": self.role, "seen_s_ago": round(self.age, 1)}


@dataclass(frozen=True)
class Leadership:
    """Who holds the leader lease, as read from the store; times are the database's clock.

    ``holder`` is None when no one ever led or the last leader released it; an expired
    lease keeps its holder's name (``expired`` says so) until someone takes it. ``taken``:
    when the current epoch began (the last takeover). ``now``: the database's clock at the
    read, so ``expires - now`` is how long the lease has left without trusting a local clock.
    """

    holder: str | None
    epoch: int
    expires: float | None
    taken: float | None
    renewed: float | None
    now: float

    @property
    def expired(self) -> bool:
        return self.expires is None or self.expires <= self.now

    @property
    def leader(self) -> str | None:
        """The holder whose lease is in force, or None (free, released or lapsed)."""
        return None if self.holder is None or self.expired else self.holder
