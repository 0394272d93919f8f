"""Placement's data: where a replica's shards run, and why a candidate was refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw.catalog import ModelName, NodeId


@dataclass(frozen=True)
class Shard:
    """One node's part of a replica. ``holds_weights`` is false for a llama.cpp worker, which the
    head sends its layers over RPC: it needs memory (and its GPUs), not room for the weights."""

    node: NodeId
    rank: int
    gpus: tuple[int, ...]
    holds_weights: bool = True


@dataclass(frozen=True)
class Placement:
    """One replica's resources: carried by the replica so usage never needs the catalog again.

    A replica of a model that left the catalog still holds its GPUs until it is stopped;
    recording what it took here is what lets placement count it.
    """

    model: ModelName
    profile: str
    shards: tuple[Shard, ...]
    memory_gb: float = 0.0
    size_gb: float = 0.0
    weights: str | None = None  # cache name, None for an operator's own copy

    @property
    def nodes(self) -> tuple[NodeId, ...]:
        return tuple(s.node for s in self.shards)


@dataclass(frozen=True)
class Rejection:
    model: ModelName
    profile: str
    node: NodeId
    reason: str

    def __str__(self) -> str:
        return f"{self.model}/{self.profile} on {self.node}: {self.reason}"


@dataclass(frozen=True)
class PlacementResult:
    placements: tuple[Placement, ...] = ()
    rejections: tuple[Rejection, ...] = ()
    unplaced: Mapping[str, int] = field(default_factory=dict)
