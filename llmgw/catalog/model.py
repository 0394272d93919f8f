"""The validated catalog as frozen data: what every other part of llmgw reads.

Nothing here does I/O. A `Catalog` only exists once validation passed, so code that
holds one may rely on unique names, existing fallbacks and parsed durations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, NewType

# The cache name is the agent's rule, imported from where the agent is built (stdlib only):
# one definition for the nodes and the controller.
from llmgw.agent.parts.protocol import cache_name

ModelName = NewType("ModelName", str)
NodeId = NewType("NodeId", str)

Engine = Literal["vllm", "sglang", "llama.cpp", "sim"]
Task = Literal["chat", "completion", "embedding"]
Routing = Literal["least-outstanding", "prefix"]
Transport = Literal["ssh", "local"]

def is_operator_path(source: str) -> bool:
    """A plain absolute path is an operator's copy on the nodes: never fetched or deleted."""
    return source.startswith("/")


SIM_SCHEME = "sim://"


def needs_weights(source: str) -> bool:
    """Whether a source is fetched into the cache: not an operator's copy, not the simulator's."""
    return not (is_operator_path(source) or source.startswith(SIM_SCHEME))


@dataclass(frozen=True)
class Scaling:
    min: int = 1
    max: int = 1
    idle_after: float | None = None  # seconds; None = never stopped for idleness
    target_inflight: int = 16


Strategy = Literal["replace", "canary"]
NoTraffic = Literal["wait", "promote", "rollback"]


@dataclass(frozen=True)
class CanaryChecks:
    """What a canary must not do worse than the stable replicas, over the same interval.

    ``error_rate``: percentage points the canary's error rate may exceed the stable's by (a
    fleet whose clients send bad requests fails on both alike). ``ttft_p95``/``itl_p95``: the
    canary's p95 time to first token and inter-token latency at most this many times the
    stable's. ``min_requests``: a step is judged only once the canary (and the stable group)
    served this many requests in it; until then it waits for traffic.
    """

    error_rate: float = 2.0
    ttft_p95: float = 2.0
    itl_p95: float = 2.0
    min_requests: int = 20


@dataclass(frozen=True)
class Acceptance:
    """One prompt a new replica of the model must answer as expected before any client is sent to
    it (issue 37): deterministic settings (temperature 0, a fixed seed), ``max_tokens`` at most;
    the answer must contain every ``contains`` and no ``not_contains`` (both case-insensitive),
    match ``matches`` (a regular expression, searched), parse as JSON valid against
    ``json_schema`` (kept as its JSON text), and come within ``latency`` seconds."""

    name: str
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); none: ``prompt`` (a completion)
    prompt: str | None = None
    max_tokens: int = 32
    contains: tuple[str, ...] = ()
    not_contains: tuple[str, ...] = ()
    matches: str | None = None
    json_schema: str | None = None
    latency: float | None = None


@dataclass(frozen=True)
class RolloutPolicy:
    """How a change of a model's fingerprint reaches its replicas (DESIGN §5, Rollouts).

    ``replace``: a new replica beside each old one, the old stopped once the new serves.
    ``canary``: one replica of the new version takes ``steps`` percent of the traffic in turn,
    each step judged by ``checks`` after ``interval`` seconds; then the rest are replaced. A step
    that has not seen ``checks.min_requests`` within ``traffic_timeout`` seconds does what
    ``on_no_traffic`` says: keep waiting (said, once), promote unjudged, or roll back.
    In both, at most ``max_surge`` new replicas are started beside old ones at a time, and when
    the fleet has no room for them, ``max_unavailable`` old ones are stopped first instead.
    """

    strategy: Strategy = "replace"
    steps: tuple[float, ...] = (10.0, 50.0)
    interval: float = 60.0
    checks: CanaryChecks = field(default_factory=CanaryChecks)
    max_surge: int = 1
    max_unavailable: int = 1
    traffic_timeout: float | None = None  # None: 3 intervals, at least 15 minutes
    on_no_traffic: NoTraffic = "rollback"
    acceptance: tuple[Acceptance, ...] = ()

    @property
    def traffic_wait(self) -> float:
        """Seconds a step waits for its requests before ``on_no_traffic``."""
        return self.traffic_timeout if self.traffic_timeout is not None else max(900.0, 3 * self.interval)


@dataclass(frozen=True)
class Profile:
    name: str
    priority: int
    engine: Engine
    gpus: int
    nodes: int = 1
    gpu_class: tuple[str, ...] = ()
    gpu_memory_gb: float | None = None
    memory_gb: float | None = None
    pool: str | None = None
    fabric: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def sharded(self) -> bool:
        return self.nodes > 1


@dataclass(frozen=True)
class Model:
    name: ModelName
    source: str
    size_gb: float
    profiles: tuple[Profile, ...]
    aliases: tuple[str, ...] = ()
    task: Task = "chat"
    scaling: Scaling = field(default_factory=Scaling)
    fallbacks: tuple[ModelName, ...] = ()
    routing: Routing = "least-outstanding"
    rollout: RolloutPolicy = field(default_factory=RolloutPolicy)
    file: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a client may use for this model, canonical name first."""
        return (self.name, *self.aliases)

    @cached_property
    def cache_name(self) -> str | None:
        """Cache entry on a node; None for an operator's own copy or the simulator (never fetched)."""
        return cache_name(self.source) if needs_weights(self.source) else None

    @property
    def weights_ref(self) -> str | None:
        """What the agent is told to load: the cache entry, an operator's path, or nothing (sim)."""
        return self.cache_name or (self.source if is_operator_path(self.source) else None)

    def profiles_by_priority(self) -> tuple[Profile, ...]:
        return tuple(sorted(self.profiles, key=lambda p: p.priority))

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)


@dataclass(frozen=True)
class GpuSpec:
    count: int
    gpu_class: str
    memory_gb: float


@dataclass(frozen=True)
class NodeSpec:
    id: NodeId
    address: str
    port: int = 22
    user: str = "llmgw"
    transport: Transport = "ssh"
    pool: str = "default"
    fabric: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    gpus: GpuSpec | None = None
    memory_gb: float | None = None
    disk_gb: float | None = None
    agent_config: str | None = None  # the agent's --config on the node; None: the agent's own default


@dataclass(frozen=True)
class PruneGuard:
    max_model_share: float = 0.5
    max_replica_share: float = 0.5


@dataclass(frozen=True)
class Budget:
    tokens: int
    per: Literal["day", "month"]
    reset: str = "00:00"  # HH:MM UTC when a period starts (the schema checked the form)

    @property
    def reset_minute(self) -> int:
        return int(self.reset[:2]) * 60 + int(self.reset[3:5])


@dataclass(frozen=True)
class Limits:
    """A tenant's limits (None: no limit of that kind)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent: int | None = None
    budget: Budget | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...]
    limits: Limits = field(default_factory=Limits)
    models: tuple[tuple[str, Limits], ...] = ()  # per model name, on top of ``limits``


@dataclass(frozen=True)
class Settings:
    pools: tuple[str, ...] = ()
    default_scaling: Scaling = field(default_factory=Scaling)
    default_rollout: RolloutPolicy = field(default_factory=RolloutPolicy)
    prune_guard: PruneGuard = field(default_factory=PruneGuard)
    env_allow: tuple[str, ...] = ()
    tenants: tuple[Tenant, ...] = ()


@dataclass(frozen=True)
class Catalog:
    models: tuple[Model, ...] = ()
    nodes: tuple[NodeSpec, ...] = ()
    settings: Settings = field(default_factory=Settings)
    revision: str | None = None
    # The commit carried ``Llmgw-Skip-Analysis: yes``: a canary rollout it starts skips the
    # analysis (an emergency fix goes out at once, max_surge/max_unavailable still apply).
    skip_analysis: bool = False
    _index: dict[str, Model] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Validation guarantees names and aliases are unique, so one flat index serves
        # every lookup a request makes.
        index: dict[str, Model] = {}
        for m in self.models:
            for n in m.names:
                index.setdefault(n, m)
        object.__setattr__(self, "_index", index)

    def resolve(self, name_or_alias: str) -> Model | None:
        """The model a client means by ``name_or_alias``, or None."""
        return self._index.get(name_or_alias)

    def model(self, name: str) -> Model | None:
        m = self._index.get(name)
        return m if m is not None and m.name == name else None

    def node(self, node_id: str) -> NodeSpec | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    @property
    def model_names(self) -> tuple[ModelName, ...]:
        return tuple(m.name for m in self.models)

    def wanted_cache_names(self) -> frozenset[str]:
        """Cache entries this catalog wants kept on nodes; anything else cache-named is an orphan."""
        return frozenset(n for n in (m.cache_name for m in self.models) if n is not None)
