"""The endpoint table and replica selection: which engine gets the next request.

The control plane publishes the ready replicas as a list of :class:`Endpoint`; the router turns
it into an :class:`EndpointTable` in one step and swaps the reference, so a request always sees
one whole table and never waits for the control plane. Per-replica counters (in flight, the
engine's own queue, cool-down) live in :class:`Upstream` objects that survive a new table when
the replica does, so a request that started under the old table decrements the same counter the
new table reads.

Selection (DESIGN §6): the lowest ``priority`` value first; within one priority, weighted
least-outstanding — this router's own in-flight count plus the queue other clients put on the
engine (read from its ``/metrics``) — divided by the replica's weight. Ties are broken at random
(weighted), so at low load traffic spreads instead of always landing on the first replica. A
replica that failed recently is cooling down and only used when nothing else of its model is
left. Nothing here does I/O; time and randomness are passed in.

Progressive delivery (DESIGN §5): while a model has a canary, its replicas form two tracks, the
canary's and the stable ones', each with its own priority groups (built with the table, so a
model without a canary pays nothing per request). A request's one uniform draw, made once in the
handler, picks the track (its retries stay on it: one version per request); selection, prefix
affinity included, runs within the track. Only when the drawn track has no replica left to try
does the request go to the other: a canary that failed before the first byte must not cost a
client a request the stable version could serve.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.contract import Endpoint
from llmgw.router.engines import engine_profile
from llmgw.router.prefix import PrefixIndex, PromptKey, rendezvous
from llmgw.router.routes import RouteModel
from llmgw.router.upstream import Origin

log = logging.getLogger(__name__)

API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class Upstream:
    """One ready replica and the router's live knowledge of it (mutable, owned by the event loop)."""

    __slots__ = ("endpoint", "replica_id", "model", "url", "origin", "heads", "weight", "inflight", "external",
                 "engine_load", "cooldown_until", "failures", "prefixes", "prefix_totals", "engine",
                 "engine_tokens", "read_stamp")

    def __init__(self, endpoint: Endpoint) -> None:
        self.replica_id = endpoint.replica_id
        self.url = endpoint.url.rstrip("/")
        self.engine = engine_profile(endpoint.engine)  # its quirks, looked up once (llmgw.router.engines)
        # Parsed once, with each path's request head prebuilt: nothing is formatted per request.
        self.origin = Origin(self.url, reuse=self.engine.reuse_connections)
        self.heads = {p: self.origin.head(p) for p in API_PATHS}
        self.inflight = 0          # this router's requests on it right now
        self.external = 0          # requests on the engine that are not this router's (from /metrics)
        self.engine_load: tuple[int, int] | None = None  # (running, waiting) as the engine last said
        # (prompt, generated) tokens its engine counted since it started, as last read (None: not read)
        self.engine_tokens: tuple[float | None, float | None] | None = None
        # Which reading of its engine was applied last (llmgw.router.load): one begun earlier that
        # answers later is not applied over it (counters read going backwards look like a restart).
        self.read_stamp = 0
        self.cooldown_until = 0.0  # monotonic time; skipped until then when anything else is left
        self.failures = 0
        self.prefixes: PrefixIndex | None = None  # prompts sent here, for models routed by prefix
        self.prefix_totals: tuple[float, float] | None = None  # the engine's prefix-cache counters, last read
        self.endpoint = endpoint
        self.update(endpoint)

    def update(self, endpoint: Endpoint) -> None:
        if endpoint.ready_since != self.endpoint.ready_since:
            self.forget_prompts()  # the engine was started again: its cache is empty
            self.prefix_totals = None
        self.endpoint = endpoint
        self.engine = engine_profile(endpoint.engine)
        self.model = endpoint.model
        # A weight of 0 (or less) means "only when nothing else is free": it never wins a tie.
        self.weight = endpoint.weight if endpoint.weight > 0 else 1e-9

    def load(self) -> float:
        return (self.inflight + self.external) / self.weight

    def forget_prompts(self) -> None:
        if self.prefixes is not None:
            self.prefixes.clear()

    def __repr__(self) -> str:
        return f"Upstream({self.replica_id!r}, {self.url!r}, inflight={self.inflight})"


Groups = tuple[tuple[Upstream, ...], ...]  # a model's replicas by priority, lowest value first


@dataclass(frozen=True)
class Split:
    """A model's traffic split while it has a canary: ``percent`` of its requests to the canary's
    replicas, the rest to the stable ones, each track with its own priority groups."""

    percent: float
    canary: Groups
    stable: Groups

    def tracks(self, draw: float) -> tuple[Groups, Groups]:
        """The drawn track first, the other as the last resort."""
        if draw * 100.0 < self.percent:
            return self.canary, self.stable
        return self.stable, self.canary


class EndpointTable:
    """An immutable view of the ready replicas: per model, priority groups in order, and the
    split of each model that has a canary."""

    __slots__ = ("groups", "upstreams", "version", "splits")

    def __init__(self, groups: Mapping[str, Groups], upstreams: Mapping[str, Upstream], *, version: int,
                 splits: Mapping[str, Split] | None = None) -> None:
        self.groups = groups
        self.upstreams = upstreams
        self.version = version
        self.splits: Mapping[str, Split] = splits or {}

    def has(self, model: str) -> bool:
        return model in self.groups

    def of(self, model: str) -> tuple[Upstream, ...]:
        return tuple(u for g in self.groups.get(model, ()) for u in g)


EMPTY = EndpointTable({}, {}, version=0)


def build_table(endpoints: Sequence[Endpoint], previous: EndpointTable) -> EndpointTable:
    """The table for ``endpoints``, reusing the previous :class:`Upstream` of every replica that
    stays at the same URL (its in-flight count and cool-down carry over)."""
    upstreams: dict[str, Upstream] = {}
    for ep in endpoints:
        if ep.replica_id in upstreams:
            continue  # one replica published twice: the first entry wins
        old = previous.upstreams.get(ep.replica_id)
        if old is not None and old.url == ep.url.rstrip("/"):
            old.update(ep)
            upstreams[ep.replica_id] = old
            continue
        try:
            upstreams[ep.replica_id] = Upstream(ep)
        except ValueError as exc:
            log.warning("ignoring endpoint %s of %s: %s", ep.replica_id, ep.model, exc)
    by_model: dict[str, dict[int, list[Upstream]]] = {}
    for u in upstreams.values():
        by_model.setdefault(u.model, {}).setdefault(u.endpoint.priority, []).append(u)
    groups = {model: tuple(tuple(prio[p]) for p in sorted(prio)) for model, prio in by_model.items()}
    splits = {}
    for model, model_groups in groups.items():
        split = _split(model, model_groups)
        if split is not None:
            splits[model] = split
    return EndpointTable(groups, upstreams, version=previous.version + 1, splits=splits)


def _split(model: str, groups: Groups) -> Split | None:
    """The model's split, or None when it has none: no canary replica, a share of 0 (or not a
    number), or no stable replica left (everything goes to what exists). A share of 100 or more
    sends every request to the canary, the stable replicas remaining its retry."""
    canaries = [u for g in groups for u in g if u.endpoint.canary]
    if not canaries:
        return None
    percent = min(canaries[0].endpoint.canary_percent, 100.0)
    if others := {u.endpoint.canary_percent for u in canaries[1:]} - {canaries[0].endpoint.canary_percent}:
        # The control plane publishes one share per model; two mean a bug upstream, said once per table.
        log.warning("canary replicas of %s carry different shares (%s and %s); using %s", model,
                    canaries[0].endpoint.canary_percent, sorted(others), percent)
    if not percent > 0.0:  # also NaN
        return None
    canary = tuple(t for t in (tuple(u for u in g if u.endpoint.canary) for g in groups) if t)
    stable = tuple(t for t in (tuple(u for u in g if not u.endpoint.canary) for g in groups) if t)
    if not stable:
        return None
    return Split(percent, canary, stable)


def choose(table: EndpointTable, chain: Sequence[RouteModel], now: float, rng: random.Random,
           tried: tuple[Upstream, ...] = (), prompt: PromptKey | None = None,
           imbalance: float = 4.0, *, draw: float = 1.0) -> tuple[RouteModel, Upstream] | None:
    """Where to send a request for ``chain[0]``: the model (or the fallback) and the replica, or
    None when nothing in the chain has a replica left to try. Pure: the handler applies it.

    A healthy replica anywhere in the chain (the model, then its fallbacks in order) comes before
    one that failed in the last few seconds. A model routed by ``prefix`` is picked by
    :func:`pick_prefix` when the request has a ``prompt`` key, else like any other.

    ``draw`` is the request's own uniform number in [0, 1), the same for each of its attempts:
    for a model with a :class:`Split` (a fallback's own too), below its share the canary's
    replicas are tried first, else the stable ones; the other track only once the drawn one has
    nothing left. The default 1.0 never draws the canary.
    """
    splits = table.splits
    for cooled in (False, True):
        for m in chain:
            groups = table.groups.get(m.name)
            if groups is None:
                continue
            split = splits.get(m.name) if splits else None
            for track in (groups,) if split is None else split.tracks(draw):
                if prompt is not None and m.routing == "prefix":
                    up = pick_prefix(track, now, prompt, imbalance, tried, cooled=cooled)
                else:
                    up = pick(track, now, rng, tried, cooled=cooled)
                if up is not None:
                    return m, up
    return None


def pick(groups: Iterable[tuple[Upstream, ...]], now: float, rng: random.Random,
         exclude: tuple[Upstream, ...] = (), *, cooled: bool = True) -> Upstream | None:
    """The replica to try next, or None when every replica is excluded.

    ``exclude`` holds the replicas this request already tried. A replica cooling down is
    returned only when every other candidate is excluded or cooling too (a model whose every
    replica hiccuped is still tried rather than refused), and never when ``cooled`` is False.
    """
    cooling: Upstream | None = None
    for group in groups:
        best: list[Upstream] = []
        best_load = 0.0
        live, cooling = _live(group, now, exclude, cooling)
        for u in live:
            load = u.load()
            if not best or load < best_load:
                best, best_load = [u], load
            elif load == best_load:
                best.append(u)
        if best:
            if len(best) == 1:
                return best[0]
            weights = [u.weight for u in best]
            if min(weights) == max(weights):
                return rng.choice(best)
            return rng.choices(best, weights)[0]
    return cooling if cooled else None


def pick_prefix(groups: Iterable[tuple[Upstream, ...]], now: float, prompt: PromptKey, imbalance: float,
                exclude: tuple[Upstream, ...] = (), *, cooled: bool = True) -> Upstream | None:
    """The replica for a prompt: the one holding its longest start, among those whose load is
    within ``imbalance`` of the least loaded; with no start held anywhere, the least loaded (and
    of those, the one whose index holds the fewest blocks, as SGLang's router picks the smallest tree).

    Within one priority group. The imbalance bound is what keeps one hot prefix from pinning one
    replica: once its replica is that much busier than the idlest, load wins, and the other
    replica learns the prefix too. Remaining ties go by rendezvous hashing of the prompt's anchor,
    so routers whose indexes are alike (fresh ones, or ones seeing the same traffic) place a new
    prompt on the same replica without sharing anything. Cooling replicas as in :func:`pick`.
    """
    cooling: Upstream | None = None
    for group in groups:
        healthy, cooling = _live(group, now, exclude, cooling)
        if not healthy:
            continue
        live = [(u, u.load()) for u in healthy]
        least = min(load for _, load in live)
        best: list[Upstream] = []
        best_key = (0, 0.0)
        for u, load in live:
            held = u.prefixes.match(prompt.hashes) if u.prefixes is not None and load <= least + imbalance else 0
            key = (held, -load)
            if held and key > best_key:
                best, best_key = [u], key
            elif held and key == best_key:
                best.append(u)
        if not best:
            # Nothing held anywhere: the least loaded, and of those the one remembering least,
            # so new prompts spread over the caches instead of crowding one that looks as idle.
            idle = [u for u, load in live if load == least]
            weighted = [u for u in idle if u.endpoint.weight > 0]
            idle = weighted or idle  # weight 0: only when nothing else is free, as in pick()
            fewest = min(_remembered(u) / u.weight for u in idle)
            best = [u for u in idle if _remembered(u) / u.weight == fewest]
        if len(best) == 1:
            return best[0]
        return max(best, key=lambda u: rendezvous(prompt.anchor, u.replica_id, u.weight))
    return cooling if cooled else None


def _remembered(u: Upstream) -> int:
    return 0 if u.prefixes is None else len(u.prefixes)


def _live(group: tuple[Upstream, ...], now: float, exclude: tuple[Upstream, ...],
          cooling: Upstream | None) -> tuple[list[Upstream], Upstream | None]:
    """The group's replicas not tried and not cooling, and the cooling one that recovers first."""
    live = []
    for u in group:
        if u in exclude:
            continue
        if u.cooldown_until > now:
            if cooling is None or u.cooldown_until < cooling.cooldown_until:
                cooling = u
            continue
        live.append(u)
    return live, cooling
