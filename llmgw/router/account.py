"""The last stage of a request: what the router counts of it once an engine answered.

Per API key and model, the tokens and requests used (:class:`~llmgw.tenancy.usage.UsageBook`,
from the engine's own report, else from what was streamed); per model, how prompts met cached
prefixes; per replica, what a canary is judged by (:class:`~llmgw.contract.ReplicaStats`) and
when it was last used. The router's usage source (:class:`~llmgw.router.source.RouterUsage`:
``prompt_cache``, ``replica_stats``, ``last_used``, the outbox) and its metrics read these books;
nothing here does I/O.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Protocol

from llmgw.contract import PromptCache, ReplicaStats
from llmgw.router.answer import llama_timings
from llmgw.router.engines import EngineProfile
from llmgw.router.proxy import CLIENT_GONE, Tap
from llmgw.router.usage import reported_usage
from llmgw.tenancy.admission import Limits
from llmgw.tenancy.usage import Account, Usage, UsageBook


class HasLimits(Protocol):
    """Where the tenants' limits currently are (the admission stage swaps them)."""

    @property
    def limits(self) -> Limits: ...


class Accounting:
    """The router's books. ``wall`` is the clock usage is stamped with (by minute)."""

    def __init__(self, tenancy: HasLimits, *, wall: Callable[[], float]) -> None:
        self._tenancy = tenancy
        self._wall = wall
        self.usage = UsageBook()  # per (key name, model served) since start, and by minute for the ledger
        # model -> [prompt blocks routed by prefix, of which held, engine prompt tokens, of which cached]
        self.cache_counts: dict[str, list[int]] = {}
        # model -> [prompt tokens, cached] from engine-wide counters (vLLM's /metrics): every router
        # reading one engine sees the same totals, so these stay out of the reports routers sum.
        self.polled_counts: dict[str, list[int]] = {}
        # What this process measured of each replica since it started, for canary analysis: the
        # controller takes differences, so a restarted router is a new instance, never a reset.
        self.instance_id = uuid.uuid4().hex
        self.stats: dict[str, ReplicaStats] = {}
        self.last_used: dict[str, float] = {}  # replica -> unix time a request last started or finished on it

    # --- replicas joining and leaving the table ----------------------------------------------
    def replicas_changed(self, *, gone: Iterable[str], present: Iterable[str]) -> None:
        for rid in gone:
            self.last_used.pop(rid, None)
            self.stats.pop(rid, None)
        for rid in present:
            if rid not in self.stats:
                self.stats[rid] = ReplicaStats()

    # --- counting ---------------------------------------------------------------------------
    def answer_tap(self, model: str, account: Account, engine: EngineProfile) -> Tap:
        """What is counted from an answer's end: usage per key and model, and (an engine whose
        answers carry timings, which say how much of the prompt it took from its cache)
        prompt-cache hits."""
        timed = engine.timings

        def tap(tail: bytes, events: int, running: tuple[int, int] | None, complete: bool) -> tuple[int, int] | None:
            timings = llama_timings(tail) if timed and complete else None
            reported = None if not complete else reported_usage(tail) or (
                (timings.prompt, timings.predicted) if timings is not None else None)
            # Cut short: the engine's running count at the last event the client was handed; an
            # engine that reported nothing as it went: its content events (router/usage.py).
            reported = reported or running
            limits = self._tenancy.limits
            # By minute on the limits' clock (Redis's when shared), as admission is: a router whose
            # own clock is off would report its use in another budget period.
            self.usage.answered(account, model, complete=complete, reported=reported,
                                streamed=events if tail else None, minute=int(self._wall() + limits.offset) // 60 * 60,
                                tenant=limits.tenant(account.key) or "")
            if timings is not None:
                counts = self._counts(model)
                counts[2] += timings.prompt
                counts[3] += timings.cached
            return reported
        return tap

    def refused(self, key: str, model: str) -> None:
        """A request of ``key`` its tenant's limits refused (``model`` "" when refused before its
        body was read), counted on the limits' clock like an answer."""
        limits = self._tenancy.limits
        self.usage.count(key, model, Usage(refused=1), minute=int(self._wall() + limits.offset) // 60 * 60,
                         tenant=limits.tenant(key) or "")

    def prompt_blocks(self, model: str, *, routed: int, held: int) -> None:
        """A request routed by prefix: ``routed`` prompt blocks, ``held`` of them on the replica chosen."""
        counts = self._counts(model)
        counts[0] += routed
        counts[1] += held

    def engine_counts(self, model: str, queries: float, hits: float) -> None:
        """From the load poller: an engine's prefix-cache counters moved (vLLM)."""
        counts = self.polled_counts.setdefault(model, [0, 0])
        counts[0] += round(queries)
        counts[1] += round(min(hits, queries))

    def _counts(self, model: str) -> list[int]:
        counts = self.cache_counts.get(model)
        if counts is None:
            counts = self.cache_counts[model] = [0, 0, 0, 0]
        return counts

    def observe(self, rid: str, *, failed: bool, status: int | None, whole: bool, tapped: bool, start: float,
                first: float | None, last: float | None, end: float, events: int, broken: bool,
                outputs: int | None) -> None:
        """One attempt's outcome in its replica's :class:`ReplicaStats` (what a canary is judged by).

        An error, the replica's doing: the attempt failed (any reason), the engine answered 5xx
        or 429 (a version that cannot keep up with what the stable one serves is a broken
        version; a fleet simply overloaded refuses in both groups alike, which the analysis
        compares), cut a stream (broke it, or ended it before its end marker) or said in the
        stream that it failed (``broken``). A refusal, the request's doing as much as the
        version's: any other 4xx (every version would refuse ``{"messages": []}``; a client
        sending only such requests decided a canary when they were errors). The router's own
        429s (tenants' limits) never reach here, as they never reach a replica. Not counted at
        all: the client went away before the answer was whole, nor a replica no longer in the
        table. Latencies only for answers served (2xx), so fast refusals cannot make a broken
        version look fast: a stream's time to its first chunk and its mean time between content
        events up to the engine's end marker (``last``: when those bytes came, whatever the
        client's pace); a whole answer's time per output token (``outputs``, its usage).
        """
        stats = self.stats.get(rid)  # made with the table (replicas_changed): a replica gone is not counted
        if stats is None:
            return
        if broken:
            stats.observe(error=True)
            return
        if not failed:
            if status is None or (status == CLIENT_GONE and not whole):
                return
            if status == CLIENT_GONE or status < 300:  # a client that hung up at the end got its answer
                if tapped and not whole:  # the engine cut it short
                    stats.observe(error=True)
                    return
                if first is None:  # a whole answer
                    stats.observe(error=False, tpot=(end - start) / outputs if outputs else None)
                    return
                until = last if last is not None else end
                stats.observe(error=False, ttft=first - start,
                              itl=(until - first) / (events - 1) if events >= 2 else None)
                return
            if 400 <= status < 500 and status != 429:
                stats.observe(error=False, refused=True)
                return
            failed = status >= 400
        stats.observe(error=failed)

    # --- reading the books ----------------------------------------------------------------
    def prompt_cache(self, *, polled: bool = True) -> dict[str, PromptCache]:
        out = {m: PromptCache(*c) for m, c in self.cache_counts.items()}
        if polled:
            for m, (prompt, cached) in self.polled_counts.items():
                out[m] = out.get(m, PromptCache()) + PromptCache(prompt_tokens=prompt, cached_tokens=cached)
        return out

    def replica_stats(self) -> dict[str, dict[str, ReplicaStats]]:
        return {self.instance_id: {rid: s.copy()
                                   for rid, s in self.stats.items()}}

    def usage_by_tenant(self) -> dict[tuple[str, str, str], Usage]:
        """Totals per (tenant, key, model), for the metrics."""
        tenant = self._tenancy.limits.tenant
        return {(tenant(key) or "", key, model): u for (key, model), u in self.usage.totals.items()}
