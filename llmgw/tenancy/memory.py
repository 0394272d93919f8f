"""Tenants' limits counted in this router's memory (issue 18): every tenant's scopes by key name
(:class:`Limiter`), the tickets of requests admitted from them, and :class:`LocalLimits`, the
:class:`~llmgw.tenancy.admission.Limits` of a router that shares its counts with nobody. The
rules are :mod:`llmgw.tenancy.rules`; this module keeps the counts they apply to. The shared
limits keep their scopes here too, and count here alone while Redis is away (degraded mode).

For one router process. Pure: the clock is passed in; nothing here does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from llmgw.catalog.model import Tenant
from llmgw.contract import period_start
from llmgw.tenancy import rules
from llmgw.tenancy.rules import Refusal, Scope


class Ticket:
    """An admitted request: settle its real tokens, then release it (both at most once)."""

    __slots__ = ("_scopes", "_periods", "_reserved", "_settled", "_released", "_floor", "_clock")

    def __init__(self, scopes: tuple[Scope, ...], reserved: int, clock: Callable[[], float]) -> None:
        self._scopes = scopes
        self._clock = clock
        self._periods = tuple(s.period for s in scopes)  # the budget periods it was admitted in
        self._reserved = reserved
        self._settled = False
        self._released = False
        self._floor = 0

    def charge_at_least(self, tokens: int) -> None:
        """What the request is charged if it ends unsettled (an engine was sent its prompt, and
        a retry elsewhere may still settle what it really used)."""
        self._floor = max(self._floor, tokens)

    def settle(self, tokens: int) -> None:
        """The request's real prompt + completion tokens: the reservation is replaced by them."""
        if self._settled:
            return
        self._settled = True
        now = self._clock()
        for s, period in zip(self._scopes, self._periods, strict=True):
            rules.settle(s, self._reserved, tokens, period, now)

    def release(self) -> None:
        """The request ended; unsettled, it is charged :meth:`charge_at_least`'s figure (0: it
        reached no engine)."""
        if self._released:
            return
        self._released = True
        self.settle(self._floor)
        for s in self._scopes:
            rules.end(s)


_UNKNOWN = object()


class Limiter:
    """Every tenant's scopes, by key name."""

    def __init__(self, tenants: Iterable[Tenant] = ()) -> None:
        self._tenant_of: dict[str, str] = {}
        # The tenant of an API key by name (None: in none): asked several times a request, so
        # the dictionary's own lookup rather than a method around it.
        self.tenant: Callable[[str], str | None] = self._tenant_of.get
        self._scopes: dict[tuple[str, str], Scope] = {}
        # The ledger's figures, by (tenant, model or ""), and the routers the controller knows of.
        self._ledger: dict[tuple[str, str], tuple[float, int]] = {}
        self.routers = 1
        # The time of day a settlement happens at (its tokens bucket refilled to then first); the
        # router's wall clock, or a test's. Admissions are given theirs.
        self.clock: Callable[[], float] = time.time
        self.degraded = False  # budgets granted from this router's share (see degrade())
        # Asked on every request with a key: found once per key and model chain.
        self._scopes_of: dict[tuple[str, tuple[str, ...]], tuple[Scope, ...] | None] = {}
        self._budgeted: dict[tuple[str, tuple[str, ...]], bool] = {}  # as often, and as bounded
        for t in tenants:
            for k in t.keys:
                self._tenant_of.setdefault(k, t.name)
            self._scopes[(t.name, "")] = Scope(t.name, t.limits)
            for model, limits in t.models:
                self._scopes[(t.name, model)] = Scope(f"{t.name}/{model}", limits)

    def carry_over(self, old: Limiter) -> None:
        """Keep what each scope has used and has in flight across a new catalog: lowering a budget
        must not hand the tenant a fresh one. A bucket whose limit changed starts full at the new
        limit; a budget's count restarts only when its period (``per`` or ``reset``) changed."""
        for k, s in list(self._scopes.items()):
            prev = old._scopes.get(k)
            if prev is None:
                continue
            # The old scope object goes on, with the new limits: tickets in flight hold it.
            if prev.limits.requests_per_minute != s.limits.requests_per_minute:
                prev.requests = s.requests
            if prev.limits.tokens_per_minute != s.limits.tokens_per_minute:
                prev.tokens = s.tokens
            a, b = prev.limits.budget, s.limits.budget
            if a is None or b is None or (a.per, a.reset) != (b.per, b.reset):
                prev.period, prev.used = 0.0, 0
            prev.limits = s.limits
            self._scopes[k] = prev
        self._scopes_of.clear()
        self._budgeted.clear()
        self.clock = old.clock
        self.set_spent(old._ledger, routers=old.routers)

    def set_spent(self, figures: Mapping[tuple[str, str], tuple[float, int]], *, routers: int) -> None:
        """The ledger's figures (tenant, model or "" → period start, tokens used) and how many
        routers share the limits, as the controller last said. A scope the figures leave out keeps
        the figure it had: the controller leaves out a budget it has not read yet (a new leader,
        a store slow to answer), and taking that for "nothing spent" let every router grant the
        budget again meanwhile."""
        kept = {k: v for k, v in self._ledger.items() if k in self._scopes}
        kept.update(figures)
        self._ledger = kept
        more = max(1, routers) > self.routers
        self.routers = max(1, routers)
        for k, s in self._scopes.items():
            s.ledger = self._ledger.get(k, (0.0, 0))
            b = s.limits.budget
            if more and s.share is not None and b is not None:
                # Degraded, and told of more routers: this one's share shrinks to the new one
                # (never grows: what it granted is granted).
                s.share = min(s.share, max(0, b.tokens - s.base) // self.routers)

    def scopes(self) -> Iterable[Scope]:
        return self._scopes.values()

    def degrade(self, known: Mapping[str, tuple[float, int]], now: float, *, unseen: bool = False,
                spent: Mapping[str, int] | None = None) -> None:
        """Redis went away: from now on each budget is granted from this router's share of what
        was left (its remaining tokens per the ledger, or ``known`` — scope name → period, tokens
        Redis last said were used and reserved — whichever says more was spent, divided among the
        routers), never from a fresh budget: N routers alone must not grant N budgets. Scopes
        already degraded (carried over from the last catalog) keep their share. ``unseen``: this
        router never reached Redis since it started; it grants no budget (its share before a restart
        is not known to it). ``spent``: scope name → budget tokens this router admitted since Redis
        last answered, which no figure above knows of: taken off its share."""
        self.degraded = True
        for s in self._scopes.values():
            b = s.limits.budget
            if b is None or s.share is not None:
                continue
            start = period_start(b, now)
            seen = known.get(s.name)
            ledger, said = s.ledger_used(start), seen[1] if seen is not None and seen[0] == start else 0
            base = max(ledger, said)
            s.period, s.used, s.base = start, 0, base
            # What Redis last said counts every router's allowances as reserved, this one's with them;
            # the ledger counts none: from it, what this router took from its own since is its own to
            # take off (each router alike, so together they grant what was left).
            own = (spent or {}).get(s.name, 0) if ledger >= said else 0
            s.share = 0 if unseen else max(0, max(0, b.tokens - base) // self.routers - own)
            s.unseen = unseen

    def undegrade(self) -> None:
        """Redis answers again: budgets are counted there (the in-memory counts wait for the next time)."""
        self.degraded = False
        for s in self._scopes.values():
            s.share = None
            s.unseen = False

    def admit(self, key: str, models: tuple[str, ...], reserve: int, now: float) -> Ticket | Refusal | None:
        """A ticket, a refusal, or None when the key is in no tenant (not limited). ``models``: the
        model asked for and its fallbacks; any may serve, so the request must fit each one's limits."""
        scopes = self.scopes_of(key, models)
        if scopes is None:
            return None
        # A request no budget could hold is told so (a 400) before any limit it waits for.
        if (never := self.never_fits(scopes, reserve)) is not None:
            return never
        routers = self.routers
        for s in scopes:
            refused = rules.check(s, reserve, now, routers=routers)
            if refused is not None:
                return refused
        for s in scopes:
            rules.take(s, reserve)
        return Ticket(scopes, reserve, self.clock)

    @staticmethod
    def has_budget(scopes: Iterable[Scope]) -> bool:
        return any(s.limits.budget is not None for s in scopes)

    def scopes_of(self, key: str, models: tuple[str, ...]) -> tuple[Scope, ...] | None:
        """The scopes a request with ``key`` for ``models`` must fit; None when the key is in no tenant."""
        known = self._scopes_of.get((key, models), _UNKNOWN)
        if known is not _UNKNOWN:
            return known  # type: ignore[return-value]
        tenant = self._tenant_of.get(key)
        if tenant is None:
            scopes = None
        else:
            found = (self._scopes.get((tenant, "")), *(self._scopes.get((tenant, m)) for m in models))
            scopes = tuple(s for s in found if s is not None)
        if len(self._scopes_of) > 4096:  # keys times models, bounded whatever clients send
            self._scopes_of.clear()
        self._scopes_of[(key, models)] = scopes
        return scopes

    def budgeted(self, key: str, models: tuple[str, ...]) -> bool:
        """Whether a request with ``key`` for ``models`` falls in a scope with a budget."""
        known = self._budgeted.get((key, models))
        if known is None:
            if len(self._budgeted) > 4096:
                self._budgeted.clear()
            known = self._budgeted[(key, models)] = self.has_budget(self.scopes_of(key, models) or ())
        return known

    def tenant_scope(self, key: str) -> Scope | None:
        """The scope of the key's tenant as a whole (every model falls in it); None: not limited."""
        tenant = self._tenant_of.get(key)
        return None if tenant is None else self._scopes.get((tenant, ""))

    def precheck(self, key: str, reserve: int, now: float) -> Refusal | None:
        """A refusal that needs no body: the key's tenant cannot be admitted for any model with
        at least ``reserve`` tokens (its requests per minute, requests in flight, tokens per
        minute or budget), or None. Takes nothing; a request it lets through is checked in full."""
        s = self.tenant_scope(key)
        if s is None:
            return None
        b = s.limits.budget
        if b is not None and reserve > b.tokens:
            return rules.never_fits((s,), reserve)
        return rules.check(s, reserve, now, routers=self.routers)

    @staticmethod
    def never_fits(scopes: tuple[Scope, ...], reserve: int) -> Refusal | None:
        """A refusal when ``reserve`` alone exceeds a scope's whole budget: waiting cannot help."""
        return rules.never_fits(scopes, reserve)


class ScopedLimits:
    """What both :class:`~llmgw.tenancy.admission.Limits` keep alike: the current catalog's
    :class:`Limiter`, carried over from catalog to catalog and from one implementation to the
    other (the router switching to or from Redis keeps what each scope used)."""

    url = ""

    def __init__(self, limiter: Limiter | None = None) -> None:
        self.limiter = limiter if limiter is not None else Limiter()
        self.tenant = self.limiter.tenant  # the current limiter's: see set_tenants

    def set_tenants(self, tenants: Iterable[Tenant]) -> None:
        limiter = Limiter(tenants)
        limiter.carry_over(self.limiter)  # a new commit must not hand every tenant a fresh budget
        self.limiter = limiter
        self.tenant = limiter.tenant

    def set_spent(self, figures: Mapping[tuple[str, str], tuple[float, int]], *, routers: int) -> None:
        self.limiter.set_spent(figures, routers=routers)

    def caps_unasked(self, key: str, models: tuple[str, ...]) -> bool:
        # A budget is a cap even for a request that sets none: unasked, an engine writes up to
        # its context, many reservations past the budget (asked.capped_fields).
        return self.limiter.budgeted(key, models)


class LocalLimits(ScopedLimits):
    """Tenants' limits counted by this router alone; ``clock``: the wall clock settlements happen by."""

    degraded = False
    offset = 0.0

    def __init__(self, limiter: Limiter | None = None, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(limiter)
        self.limiter.clock = clock

    def precheck(self, key: str, reserve: int, now: float) -> Refusal | None:
        return self.limiter.precheck(key, reserve, now)

    async def admit(self, key: str, models: tuple[str, ...], reserve: int, now: float) -> Ticket | Refusal | None:
        return self.limiter.admit(key, models, reserve, now)

    async def close(self) -> None:
        return None
