"""The contract between the control plane and the data plane (DESIGN §1): all they share.

The reconciler (or a controller's feed) gives routers the ready endpoints and the part of the
catalog a router needs; routers give back when each replica was last used and the demand per
model. Both sides import this module and nothing of each other: the standalone router loads no
git, SSH or SQLite code, and the controller none of the router's request path.

A router running as its own process (``llmgw router --controller URL``) follows the controller
over one long-lived HTTP response of JSON lines::

    GET /api/v1/router/watch      Authorization: Bearer <admin token>
    {"version": 1719..., "catalog": {...catalog_view...}, "endpoints": [Endpoint.to_json(), ...]}\\n
    {"keepalive": true}\\n                         every ~10 s, so a silent drop is noticed
    {"version": ..., ...}\\n                        a full snapshot again on every change

When the controller's config names a Redis for tenants' limits (``router.limits_redis``), the
snapshot carries its URL (``"limits_redis"``), so every router counts the limits in the same
place; a router started with its own ``--limits-redis`` keeps that. When the controller's config
has API keys, the snapshot also carries them, as the hashes and
model lists the config holds (``"api_keys": [{"name", "sha256", "models"}]``), so every router
checks the same keys and a key added to the config reaches them all without a restart. A
router started with its own ``--api-keys`` file keeps that instead.

Every line is a whole snapshot, so a router that missed lines (or reconnects to a restarted
controller) needs nothing but the next one; ``version`` is informational (it starts from the
controller's clock, so it grows across restarts too). Routers report back::

    POST /api/v1/router/report    {"router_id", "last_used": {replica_id: unix_time},
                                   "demand": {model: {"held": n, "inflight": n}},
                                   "prompt_cache": {model: PromptCache.to_json()},
                                   "usage": UsageBatch.to_json()}     (only when it has rows)
    → {"ok": true, "version": ..., "usage_acked": seq}   (or "usage_resend_from": seq)

Usage goes as numbered batches of deltas (:class:`UsageBatch`): a router sends the same batch
again until the controller acknowledges its ``seq``, and the controller records each
(``instance``, ``seq``) once, in the same transaction as the rows, so a lost answer, a resent
report or a restart on either side counts nothing twice. A controller whose store lacks the
batches before this one (restored from an older copy of its data dir: the batches since were
acknowledged by the store that was lost) answers ``usage_resend_from`` instead of an ack, once per
gap: the router sends again, in order, the acknowledged batches it keeps from that number on
(USAGE_RETAINED), then the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import Any, NotRequired, Protocol, TypedDict

from llmgw.catalog import Catalog
from llmgw.catalog.model import Budget

KEEPALIVE = b'{"keepalive": true}\n'
WATCH_PATH = "/api/v1/router/watch"
REPORT_PATH = "/api/v1/router/report"


@dataclass(frozen=True)
class Endpoint:
    """What the router needs of one ready replica (the endpoint sink's unit)."""

    replica_id: str
    model: str
    names: tuple[str, ...]
    url: str
    engine: str
    profile: str
    priority: int
    task: str = "chat"
    node: str = ""
    weight: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)
    # When the engine became ready (unix time): a new value is a new engine process, whose caches
    # are empty (the router forgets which prompts it sent the old one).
    ready_since: float = 0.0
    # Progressive delivery (DESIGN §5): while a model has a canary, every endpoint of the model
    # carries the canary's share of its requests in percent (drawn once per request, so a request
    # and its retries stay on one version), and ``canary`` marks the canary's own. 0: no split.
    canary: bool = False
    canary_percent: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_ENDPOINT_FIELDS = frozenset(f.name for f in fields(Endpoint))


def endpoint_from_json(d: Mapping[str, Any]) -> Endpoint:
    """The inverse of ``Endpoint.to_json``; unknown keys (a newer controller) are ignored."""
    try:
        known = {k: v for k, v in d.items() if k in _ENDPOINT_FIELDS}
        known["names"] = tuple(known.get("names", ()))
        known["labels"] = dict(known.get("labels") or {})
        return Endpoint(**known)
    except TypeError as exc:
        raise ValueError(f"malformed endpoint: {exc}") from exc


def wire_str(v: Any) -> str:
    """A string off the wire, or TypeError: a number or null where a name belongs is malformed."""
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {v!r}")
    return v


def wire_name(v: Any) -> str:
    """A name off the wire that can be stored: a string that is valid Unicode (JSON lets a lone
    surrogate through, which SQLite cannot encode), or ValueError/TypeError."""
    s = wire_str(v)
    try:
        s.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{s!r} is not valid Unicode") from None
    return s


# Latency buckets of the per-replica measurements a canary is judged by: 1 ms to ~10 min, each
# 1.25x the last, so a p95 read off them is within 25 % of the true one (plenty to tell 2x).
LATENCY_BOUNDS: tuple[float, ...] = tuple(0.001 * 1.25 ** i for i in range(60))
_BUCKETS = len(LATENCY_BOUNDS) + 1  # the last: beyond the last bound
MAX_STATS_COUNT = 2 ** 53


def latency_bucket(seconds: float) -> int:
    """The index of the bucket ``seconds`` falls in (its upper bound is the first one >= it)."""
    lo, hi = 0, len(LATENCY_BOUNDS)
    while lo < hi:
        mid = (lo + hi) // 2
        if LATENCY_BOUNDS[mid] < seconds:
            lo = mid + 1
        else:
            hi = mid
    return lo


HISTOGRAMS = ("ttft", "itl", "tpot")  # ReplicaStats' latency histograms, by name


@dataclass
class ReplicaStats:
    """What one router saw of one replica since it started (cumulative; the controller takes
    differences over an analysis interval), each figure measuring one thing (issue 37):

    - ``requests`` sent; of those ``errors``, what the replica caused (a failed attempt, an
      engine's 5xx or 429, a stream the engine cut or ended before its end marker, an error event
      in a stream), and ``refused``, the engine's other 4xx: what a client asked that the version
      would not serve. Refusals are judged apart: a flood of requests every version refuses must
      not dilute a real error rate, and a version that refuses what the old one served is a
      finding of its own.
    - ``ttft``: streams' time to their first chunk; ``itl``: each stream's mean time between
      content events as the engine's bytes arrived (not as a slow client took them); ``tpot``:
      whole answers' time per output token (a whole answer has no first token: filed as one, a
      long answer hid a slow first token).
    """

    requests: int = 0
    errors: int = 0
    refused: int = 0
    ttft: list[int] = field(default_factory=lambda: [0] * _BUCKETS)
    itl: list[int] = field(default_factory=lambda: [0] * _BUCKETS)
    tpot: list[int] = field(default_factory=lambda: [0] * _BUCKETS)

    def observe(self, *, error: bool, refused: bool = False, ttft: float | None = None,
                itl: float | None = None, tpot: float | None = None) -> None:
        self.requests += 1
        self.errors += error
        self.refused += refused
        if ttft is not None:
            self.ttft[latency_bucket(ttft)] += 1
        if itl is not None:
            self.itl[latency_bucket(itl)] += 1
        if tpot is not None:
            self.tpot[latency_bucket(tpot)] += 1

    def __add__(self, other: ReplicaStats) -> ReplicaStats:
        return ReplicaStats(self.requests + other.requests, self.errors + other.errors, self.refused + other.refused,
                            *([a + b for a, b in zip(getattr(self, h), getattr(other, h), strict=True)]
                              for h in HISTOGRAMS))

    def __sub__(self, other: ReplicaStats) -> ReplicaStats:
        """What happened since ``other`` was read (never below zero: a router that restarted)."""
        return ReplicaStats(max(self.requests - other.requests, 0), max(self.errors - other.errors, 0),
                            max(self.refused - other.refused, 0),
                            *([max(a - b, 0) for a, b in zip(getattr(self, h), getattr(other, h), strict=True)]
                              for h in HISTOGRAMS))

    def copy(self) -> ReplicaStats:
        return ReplicaStats(self.requests, self.errors, self.refused, *(list(getattr(self, h)) for h in HISTOGRAMS))

    def covers(self, other: ReplicaStats) -> bool:
        """Every count at least ``other``'s: this is a later reading of the same router's counters."""
        return (self.requests >= other.requests and self.errors >= other.errors and self.refused >= other.refused
                and all(a >= b for h in HISTOGRAMS
                        for a, b in zip(getattr(self, h), getattr(other, h), strict=True)))

    @property
    def served(self) -> int:
        """Requests the version took on (all but those it refused): what its error rate is of."""
        return self.requests - self.refused

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.served if self.served > 0 else None

    def p95(self, which: str) -> float | None:
        """The 95th percentile of one histogram (the upper bound of its bucket), or None with no samples."""
        return self.quantile(which, 0.95)

    def quantile(self, which: str, q: float) -> float | None:
        counts = getattr(self, which)
        total = sum(counts)
        if not total:
            return None
        need, seen = q * total, 0
        for i, n in enumerate(counts):
            seen += n
            if seen >= need:
                return LATENCY_BOUNDS[min(i, len(LATENCY_BOUNDS) - 1)]
        return LATENCY_BOUNDS[-1]

    def to_json(self) -> dict[str, Any]:
        # Sparse histograms: most buckets of most replicas are empty.
        return {"requests": self.requests, "errors": self.errors, "refused": self.refused,
                **{h: {str(i): n for i, n in enumerate(getattr(self, h)) if n} for h in HISTOGRAMS}}

    @classmethod
    def from_json(cls, d: Any) -> ReplicaStats:
        """Off the wire (a router of an older llmgw sends no ``refused`` nor ``tpot``: zeros);
        ValueError/TypeError when a count or a bucket is malformed."""
        if not isinstance(d, dict):
            raise TypeError(f"replica stats must be an object, got {type(d).__name__}")
        s = cls()
        for name in ("requests", "errors", "refused"):
            v = d.get(name, 0)
            if type(v) is not int or not 0 <= v < MAX_STATS_COUNT:
                raise ValueError(f"malformed replica stats: {name} must be a whole number from 0 to 2**53")
            setattr(s, name, v)
        if s.errors + s.refused > s.requests:
            raise ValueError("malformed replica stats: more errors and refusals than requests")
        for name in HISTOGRAMS:
            hist = d.get(name) or {}
            if not isinstance(hist, dict):
                raise TypeError(f"malformed replica stats: {name} must be an object")
            counts = getattr(s, name)
            for k, v in hist.items():
                if not (isinstance(k, str) and k.isdigit() and int(k) < _BUCKETS) \
                        or type(v) is not int or not 0 <= v < MAX_STATS_COUNT:
                    raise ValueError(f"malformed replica stats: {name} bucket {k!r}")
                counts[int(k)] = v
        return s


@dataclass(frozen=True)
class Demand:
    """The router's view of a model: requests held for want of a replica, and in flight."""

    held: int = 0
    inflight: int = 0


@dataclass(frozen=True)
class PromptCache:
    """How well a model's prompts met cached prefixes, summed since each router started.

    ``blocks``/``matched``: blocks of the prompts routed by prefix, and of those the blocks the
    router's index expected the chosen replica to hold (the estimate). ``prompt_tokens``/
    ``cached_tokens``: prompt tokens the engines processed, and of those the ones they reported
    reusing from their cache (llama.cpp per answer, vLLM from its counters), whatever the policy.
    """

    blocks: int = 0
    matched: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def __add__(self, other: PromptCache) -> PromptCache:
        return PromptCache(self.blocks + other.blocks, self.matched + other.matched,
                           self.prompt_tokens + other.prompt_tokens, self.cached_tokens + other.cached_tokens)

    @property
    def estimated_hit_ratio(self) -> float | None:
        return self.matched / self.blocks if self.blocks else None

    @property
    def engine_hit_ratio(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PromptCache:
        """Off the wire; ValueError/TypeError when a count is not a non-negative whole number."""
        values = [d.get(f.name, 0) for f in fields(cls)]
        # Bounded, and parts no larger than wholes: a buggy router must not break the sums and
        # ratios the dashboard shows (a 400-digit count overflowed a float there).
        if any(type(v) is not int or not 0 <= v < 2 ** 53 for v in values):
            raise ValueError("malformed prompt-cache counts: each must be a whole number from 0 to 2**53")
        c = cls(*values)
        if c.matched > c.blocks or c.cached_tokens > c.prompt_tokens:
            raise ValueError("malformed prompt-cache counts: more matched than routed, or cached than processed")
        return c


USAGE_COUNTS = ("requests", "errors", "prompt_tokens", "completion_tokens", "counted_from_stream", "refused")
# Rows in one batch: what is counted beyond waits for the next one. ~200 bytes a row, so a batch
# stays well inside the admin API's body limit (2 MiB): a batch refused for its size would be sent
# again for ever, and the router's reports with it.
MAX_USAGE_ROWS = 2_000
# A row's counts: a trillion tokens a minute per key and model is beyond any fleet; the bound keeps
# the ledger's sums inside SQLite's 64-bit integers whatever a router sends.
MAX_USAGE_COUNT = 2 ** 40


@dataclass(frozen=True)
class UsageRow:
    """One key's use of one model in one minute, as one router counted it (a delta).

    ``minute``: the unix time the minute starts (UTC). ``tenant``: the key's tenant when the
    request was made ("" for none), kept so a key moved to another tenant later keeps its past.
    ``counted_from_stream``: requests whose tokens were counted from the stream (cut short, or an
    engine that reported none) rather than taken from the engine's usage report.
    """

    minute: int
    tenant: str
    key: str
    model: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_from_stream: int = 0
    # Requests its tenant's limits refused (rate, requests in flight, budget): never sent to an
    # engine, so not among ``requests``. ``model`` is "" for those refused before the body was read.
    refused: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UsageRow:
        """Off the wire; ValueError/TypeError when a name is not a string or a count is odd."""
        names = [wire_name(d.get(n, "")) for n in ("tenant", "key", "model")]
        numbers = [d.get("minute"), *(d.get(n, 0) for n in USAGE_COUNTS)]
        if any(type(v) is not int or not 0 <= v < MAX_USAGE_COUNT for v in numbers):
            raise ValueError("malformed usage row: minute and counts must be whole numbers from 0 to 2**40")
        if numbers[0] % 60 or any(len(n) > 256 for n in names):
            raise ValueError("malformed usage row: minute must start a minute, names at most 256 characters")
        if numbers[0] > LAST_MINUTE:  # a budget period is a calendar date: year 36812 has none (a 500 after the commit)
            raise ValueError("malformed usage row: minute must be before the year 10000")
        minute, *counts = numbers
        return cls(minute, names[0], names[1], names[2], *counts)


LAST_MINUTE = 253402300740  # 9999-12-31 23:59 UTC, the last minute a calendar date is made of


@dataclass(frozen=True)
class UsageBatch:
    """The usage one router process (``instance``) counted since its batch ``seq - 1``."""

    instance: str
    seq: int
    rows: tuple[UsageRow, ...]

    def to_json(self) -> dict[str, Any]:
        return {"instance": self.instance, "seq": self.seq, "rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UsageBatch:
        batch, problems = cls.parse(d)
        if problems:
            raise ValueError(problems[0])
        return batch

    @classmethod
    def parse(cls, d: Mapping[str, Any]) -> tuple[UsageBatch, list[str]]:
        """The batch with the rows that can be kept, and what was wrong with the others (a key
        name the controller cannot store must not cost the other keys their usage). ValueError/
        TypeError/KeyError when the batch itself (instance, seq, the list) is malformed."""
        instance, seq, rows = wire_name(d["instance"]), d["seq"], d["rows"]
        if type(seq) is not int or not 1 <= seq < 2 ** 53 or not instance or len(instance) > 256:
            raise ValueError("malformed usage batch: instance must be a name, seq a whole number from 1 to 2**53")
        if not isinstance(rows, list) or len(rows) > MAX_USAGE_ROWS:
            raise ValueError(f"malformed usage batch: rows must be a list of at most {MAX_USAGE_ROWS}")
        kept, problems = [], []
        for i, r in enumerate(rows):
            try:
                if not isinstance(r, dict):
                    raise TypeError(f"expected an object, got {type(r).__name__}")
                kept.append(UsageRow.from_json(r))
            except (ValueError, TypeError) as exc:
                problems.append(f"row {i}: {exc}")
        return cls(instance, seq, tuple(kept)), problems


# --- budgets: their periods, and what the ledger says each budget scope used in one (issue 24) ---
# The controller sums its ledger per budget period and tells every router (in the watch snapshot,
# ``"spent"`` and ``"routers"``, and in the answer to each report), so a router restarted, a
# controller restarted with its own router, or a Redis that lost its data starts from what was
# spent rather than a fresh budget. A figure is (tenant, model or "" for the tenant's own budget)
# → (start of the period, tokens used: prompt and completion, as budgets count them).
SpentFigures = dict[tuple[str, str], tuple[float, int]]


def period_start(budget: Budget, now: float) -> float:
    """Unix time the budget's current period began (day, or month from the 1st; at its UTC reset time)."""
    # Asked on every limited request: the period in hand answers until it ends (the calendar
    # arithmetic below cost a limited request a tenth of its time in the router).
    known = _PERIODS.get((budget.per, budget.reset))
    if known is not None and known[0] <= now < known[1]:
        return known[0]
    start = _period_start(budget, now)
    end = _next_period_from(budget, start)
    if len(_PERIODS) > 64:
        _PERIODS.clear()
    _PERIODS[(budget.per, budget.reset)] = (start, end)
    return start


_PERIODS: dict[tuple[str, str], tuple[float, float]] = {}


def _period_start(budget: Budget, now: float) -> float:
    t = datetime.fromtimestamp(now, UTC)
    hour, minute = divmod(budget.reset_minute, 60)
    start = t.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if budget.per == "day":
        if start > t:
            start -= timedelta(days=1)
        return start.timestamp()
    start = start.replace(day=1)
    if start > t:  # before this month's reset: the period began on the 1st of last month
        start = (start - timedelta(days=1)).replace(day=1)
    return start.timestamp()


def next_period(budget: Budget, now: float) -> float:
    return _next_period_from(budget, period_start(budget, now))


def _next_period_from(budget: Budget, period: float) -> float:
    start = datetime.fromtimestamp(period, UTC)
    if budget.per == "day":
        return (start + timedelta(days=1)).timestamp()
    return (start.replace(day=28) + timedelta(days=4)).replace(day=1).timestamp()


def spent_to_json(figures: Mapping[tuple[str, str], tuple[float, int]]) -> list[dict[str, Any]]:
    return [{"tenant": t, "model": m, "period": p, "tokens": n} for (t, m), (p, n) in sorted(figures.items())]


def spent_from_json(v: Any) -> SpentFigures:
    """Off the wire; ValueError/TypeError when malformed (a router then keeps what it had)."""
    if not isinstance(v, list):
        raise TypeError("spent must be a list")
    out: SpentFigures = {}
    for d in v:
        if not isinstance(d, dict):
            raise TypeError(f"a spent figure must be an object, got {d!r}")
        period: Any = d.get("period")
        tokens: Any = d.get("tokens")
        if type(period) not in (int, float) or not 0 <= period < 2 ** 40 or type(tokens) is not int \
                or not 0 <= tokens < 2 ** 53:
            raise ValueError(f"malformed spent figure {d!r}")
        out[(wire_str(d.get("tenant")), wire_str(d.get("model", "")))] = (float(period), tokens)
    return out


class UsageLedger(Protocol):
    """Where routers' usage is kept (the controller's store): each batch recorded at most once."""

    def record_usage(self, batch: UsageBatch) -> bool:
        """True when recorded now, False when this (instance, seq) was recorded before."""

    def usage_seq(self, instance: str) -> int:
        """The last batch number recorded for a router instance (0: none)."""


class UsageOutboxLike(Protocol):
    """A router's usage not yet in the ledger: the batch to send, and its acknowledgement."""

    def take(self) -> UsageBatch | None: ...

    def acked(self, seq: int) -> None: ...

    def resend_from(self, seq: int) -> None: ...


# Acknowledged batches a router keeps, to send again to a controller restored from an older copy
# of its store (``usage_resend_from``): at a report every second or two, the last hour or so.
USAGE_RETAINED = 2_000

class EndpointSink(Protocol):
    """Receives the endpoint list (only ready replicas). The router implements it."""

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None: ...

    def set_unrunnable(self, reasons: Mapping[str, str]) -> None:
        """Models no node can run (model name → placement reason): answered at once."""


class UsageSource(Protocol):
    """The router's report: when each replica was last used, demand and prompt-cache hits per model,
    and what each router measured of each replica (for canary analysis)."""

    def last_used(self) -> Mapping[str, float]: ...

    def demand(self) -> Mapping[str, Demand]: ...

    def prompt_cache(self) -> Mapping[str, PromptCache]: ...

    def replica_stats(self) -> Mapping[str, Mapping[str, ReplicaStats]]:
        """Per router process (an id that changes when it restarts), per replica id: what it
        measured since it started (cumulative)."""

    def in_flight_by_replica(self) -> Mapping[str, int]:
        """Per replica id: requests the routers have in flight on it, or may still send it (a
        replica withdrawn from the endpoint list counts until every router serves without it);
        the reconciler stops a withdrawn replica's engine once this is 0 (or ``drain_timeout``)."""

    def engine_queue(self) -> Mapping[str, tuple[int, int]]:
        """Per replica id: (running, waiting) on its engine as the engine's own /metrics last said
        (every client's requests, not only a router's); replicas whose engine says nothing are
        absent (llama.cpp without --metrics, an unreadable endpoint)."""

    @property
    def reads_engines(self) -> bool:
        """Whether :meth:`engine_queue` is read from the engines at all. False: it is always empty,
        and the routers' word on demand is all there is; True: a replica absent from it was not
        read, which confirms none of the demand said of it (a reading that timed out once let a
        forged report scale a model up)."""


class NoUsage:
    reads_engines = False

    def last_used(self) -> Mapping[str, float]:
        return {}

    def demand(self) -> Mapping[str, Demand]:
        return {}

    def prompt_cache(self) -> Mapping[str, PromptCache]:
        return {}

    def replica_stats(self) -> Mapping[str, Mapping[str, ReplicaStats]]:
        return {}

    def engine_queue(self) -> Mapping[str, tuple[int, int]]:
        return {}

    def in_flight_by_replica(self) -> Mapping[str, int]:
        return {}


class ScalingView(TypedDict):
    min: int
    max: int


class ModelView(TypedDict):
    name: str
    aliases: list[str]
    task: str
    fallbacks: list[str]
    scaling: ScalingView
    routing: str


class CatalogView(TypedDict):
    revision: str | None
    models: list[ModelView]
    tenants: NotRequired[list[dict[str, Any]]]  # llmgw.yaml's tenants (an older controller sends none)


def catalog_view(catalog: Catalog) -> CatalogView:
    """What a router needs of ``catalog``: names, aliases, task, fallbacks, scaling bounds, routing."""
    return {
        "revision": catalog.revision,
        "models": [{
            "name": m.name, "aliases": list(m.aliases), "task": m.task, "fallbacks": list(m.fallbacks),
            "scaling": {"min": m.scaling.min, "max": m.scaling.max}, "routing": m.routing,
        } for m in catalog.models],
        "tenants": [{"name": t.name, "keys": list(t.keys), "limits": asdict(t.limits),
                     "models": {m: asdict(lim) for m, lim in t.models}} for t in catalog.settings.tenants],
    }


# --- Several controllers, one leading (DESIGN §5 "High availability", issue 36) ----------------
# Controllers sharing one PostgreSQL store elect a leader by a lease in it; the others stand by.
# Only the leader answers the watch (WATCH_PATH) and the report (REPORT_PATH) as above, and it
# acknowledges a usage batch (``usage_acked``) only once the store has it. A standby answers both
# with STANDBY_STATUS and a body naming the leader by the admin URL it advertised (None while it
# knows of none, as in the moments between a leader's death and its lease running out)::
#
#     503 {"error": {"message": "...", "type": "standby"}, "leader": "http://ctl-b:9090" | null}
#
# A router follows that hint only to a controller it was configured with (its admin token goes to
# no address the operator did not give it), so a controller's advertised URL should be spelled
# as the routers' ``--url`` spells it; a hint naming anything else costs the router one more try.

STANDBY_STATUS = 503
STANDBY_TYPE = "standby"  # the error's ``type``: this controller is not the leader
LEADER_KEY = "leader"  # the leader's admin URL as it advertised it, or null
MAX_LEADER_URL = 2048


class StandbyError(TypedDict):
    message: str
    type: str


class StandbyAnswer(TypedDict):
    error: StandbyError
    leader: str | None


def standby_answer(leader: str | None, message: str = "this controller is standing by; the leader serves this") \
        -> StandbyAnswer:
    """The body a standby answers the watch and the report with (status :data:`STANDBY_STATUS`)."""
    return {"error": {"message": message, "type": STANDBY_TYPE}, "leader": leader}  # LEADER_KEY

