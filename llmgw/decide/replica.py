"""A replica: one running copy of a model, possibly sharded across nodes.

Its record is what the control plane remembers (persisted so a restarted controller can
adopt engines instead of restarting them); its state is what it has reached.

    pending → fetching → starting → ready → stopping → stopped
        └──────────┴──────────┴────────┴──→ failed (retried with backoff)
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any

from llmgw.catalog import Model, ModelName, NodeId, Profile
from llmgw.placement import Placement, Shard


class ReplicaState(str, Enum):
    PENDING = "pending"
    FETCHING = "fetching"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def live(self) -> bool:
        """Counts toward a model's replicas: on its way up, or up."""
        return self in (ReplicaState.PENDING, ReplicaState.FETCHING, ReplicaState.STARTING,
                        ReplicaState.READY, ReplicaState.FAILED)


@dataclass(frozen=True)
class ShardStatus:
    node: NodeId
    rank: int
    gpus: tuple[int, ...]
    agent_id: str  # the engine's replica_id on that node's agent
    pid: int | None = None
    port: int | None = None
    endpoint: str | None = None
    state: str = "pending"  # pending | fetching | started | exited


@dataclass(frozen=True)
class Replica:
    id: str
    model: ModelName
    profile: str
    placement: Placement
    generation: int
    fingerprint: str  # of what the engine was started with: a change means replace
    state: ReplicaState = ReplicaState.PENDING
    shards: tuple[ShardStatus, ...] = ()
    created_at: float = 0.0
    state_since: float = 0.0
    ready_since: float | None = None
    error: str | None = None
    failures: int = 0
    retry_at: float | None = None
    replaces: str | None = None  # id of the replica this one will take over from
    stop_reason: str | None = None
    adopted: bool = False
    revision: str | None = None
    canary: bool = False  # the new version of a model in a rollout's canary phase (llmgw.decide.rollout)

    @property
    def endpoint(self) -> str | None:
        """Where clients are served: rank 0's engine."""
        return self.shards[0].endpoint if self.shards else None

    @property
    def nodes(self) -> tuple[NodeId, ...]:
        return self.placement.nodes

    def moved(self, state: ReplicaState, now: float, **changes: Any) -> Replica:
        """This replica in ``state`` since ``now`` (unchanged time when the state is the same)."""
        since = self.state_since if state == self.state else now
        extra: dict[str, Any] = {}
        if state == ReplicaState.READY and self.state != ReplicaState.READY:
            extra["ready_since"] = now
        return replace(self, state=state, state_since=since, **extra, **changes)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Replica:
        p = d["placement"]
        placement = Placement(
            model=p["model"], profile=p["profile"],
            shards=tuple(Shard(s["node"], s["rank"], tuple(s["gpus"]), s.get("holds_weights", True))
                         for s in p["shards"]),
            memory_gb=p.get("memory_gb", 0.0), size_gb=p.get("size_gb", 0.0), weights=p.get("weights"),
        )
        shards = tuple(ShardStatus(**{**s, "gpus": tuple(s["gpus"])}) for s in d.get("shards", ()))
        fields = {k: v for k, v in d.items() if k not in ("placement", "shards", "state")}
        return cls(placement=placement, shards=shards, state=ReplicaState(d["state"]), **fields)


@dataclass(frozen=True)
class Backoff:
    """How failed replicas are retried: ``base`` doubling up to ``cap`` seconds; a replica that
    served ``reset_after`` seconds before failing starts its count afresh; ``crash_loop_after``
    failures in a row are called a crash loop."""

    base: float
    cap: float
    reset_after: float
    crash_loop_after: int


@dataclass(frozen=True)
class Failure:
    """What one more failure of a replica makes of it."""

    count: int  # failures in a row, this one included
    delay: float  # seconds until it is started again
    crash_loop: bool
    ran: float  # seconds it had served before this failure (0 if it was not serving)
    forgot: bool  # it had served long enough that earlier failures no longer count


def next_failure(r: Replica, now: float, policy: Backoff) -> Failure:
    """The count, delay and crash-loop verdict after ``r`` fails at ``now``.

    A replica that served for ``reset_after`` before failing starts its count afresh, as Kubernetes
    resets a container's back-off after 10 minutes of running (seen: the count never forgot, so
    five crashes weeks apart were a "crash loop" at the longest backoff)."""
    ran = now - r.ready_since if r.state == ReplicaState.READY and r.ready_since is not None else 0.0
    forgot = r.failures > 0 and ran >= policy.reset_after
    count = 1 if forgot else r.failures + 1
    delay = min(policy.base * 2 ** (count - 1), policy.cap)
    return Failure(count, delay, count >= policy.crash_loop_after, ran, forgot)


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def replica_id(model: str, generation: int) -> str:
    """``<model>-g<generation>``: unique because generations only grow; agent-id safe."""
    return f"{_UNSAFE.sub('-', model)[:80]}-g{generation}"


def shard_agent_id(rid: str, rank: int) -> str:
    return f"{rid}.r{rank}"


def fingerprint(model: Model, profile: Profile) -> str:
    """What a running engine was built from; any change to it means the replica is replaced."""
    data = {
        "source": model.source,
        "task": model.task,
        "profile": asdict(profile),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def runs(replica: Replica, model: Model | None) -> bool:
    """The replica runs ``model``'s version of its profile: the one test of "this replica runs
    that version" (the profile it runs still exists, and its engine is built from the same)."""
    profile = model.profile(replica.profile) if model is not None else None
    return profile is not None and fingerprint(model, profile) == replica.fingerprint  # type: ignore[arg-type]
