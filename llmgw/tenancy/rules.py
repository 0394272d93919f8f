"""The tenants' rules (issue 18), in one place: what a request takes of each limit, when it fits,
what a refusal says, and how a budget's period turns over. Pure: the clock is passed in; no I/O.

Both limiters apply these rules: :mod:`llmgw.tenancy.memory` to counts it keeps itself, and
:mod:`llmgw.tenancy.shared` to counts kept in Redis, where a Lua script applies the same checks
atomically for every router (the arguments it is given are built here, :func:`takes`, and its
refusals are worded here, :func:`refused`). ``tests/tenancy/test_admission_table.py`` runs one
table of cases against both, so they cannot drift apart.

- **Buckets** (requests and tokens per minute) refill continuously: a limit of 60 per minute is
  one a second, with bursts up to 60.
- **Reservations**: tokens are reserved at admission (:mod:`llmgw.tenancy.asked`) and settled
  from what the engine reported when the request ends, so requests running at once cannot
  overshoot a budget by more than one reservation each, and one that used less gives the rest back.
- **Scopes**: a request must fit every scope it falls in (its tenant's limits, and that tenant's
  limits for each model that may serve it); a refusal takes nothing from any scope.
- **Periods**: a budget counts per day or month from its UTC reset time (``llmgw.contract``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from llmgw.catalog.model import Limits
from llmgw.contract import next_period, period_start

__all__ = ["Bucket", "Counts", "Refusal", "Scope", "check", "duration", "end", "never_fits", "next_period",
           "period_start", "refusal", "refused", "settle", "take", "takes"]

Kind = Literal["concurrent", "requests", "tokens", "budget"]
Counts = tuple[int, int, int, int]  # requests, tokens, budget tokens, slots (requests in flight)


def takes(limits: Limits, reserve: int) -> Counts:
    """What one request of ``reserve`` tokens takes of each limit the scope has (0: no such limit):
    a request, its tokens (at most the whole tokens-per-minute bucket: a bigger request leaves
    the bucket in debt, which later requests wait out), its budget tokens, a slot."""
    tpm = limits.tokens_per_minute
    return (1 if limits.requests_per_minute else 0,
            (reserve if reserve < tpm else tpm) if tpm else 0,
            reserve if limits.budget else 0,
            1 if limits.concurrent else 0)


@dataclass(slots=True)
class Bucket:
    """``capacity`` units, refilled at ``capacity`` per minute. A new one is full (its level is
    read before any refill: a refusal for another limit states what is left of this one)."""

    capacity: float
    level: float = math.inf  # full: capacity, once __post_init__ has run
    at: float = -math.inf    # never refilled: the first refill finds it full

    def __post_init__(self) -> None:
        if self.level > self.capacity:
            self.level = self.capacity

    def refill(self, now: float) -> float:
        if now > self.at:
            level = self.level + (now - self.at) * self.capacity / 60.0
            self.level = level if level < self.capacity else self.capacity
            self.at = now
        return self.level

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` is available (after refill)."""
        return 0.0 if self.level >= amount else (amount - self.level) * 60.0 / self.capacity


@dataclass(slots=True)
class Scope:
    """One tenant's (or one tenant-and-model's) limits and what is used of them."""

    name: str  # "tenant" or "tenant/model", as messages show it
    limits: Limits
    requests: Bucket | None = None
    tokens: Bucket | None = None
    inflight: int = 0
    period: float = 0.0  # start of the budget period the counts below belong to
    used: int = 0        # tokens settled in this period
    reserved: int = 0    # tokens reserved by requests in flight
    # What the controller's ledger says this scope used in a period (its start, tokens): every
    # router's reported use, so a router restarted mid-period (or the controller's own, restarted
    # with it) does not hand a tenant a fresh budget. At most one report interval behind.
    ledger: tuple[float, int] = (0.0, 0)
    # Degraded mode (the shared limits' Redis away): the tokens this router alone may grant this
    # period, its share of what was left; ``used`` then counts what it granted since. None: not degraded.
    share: int | None = None
    base: int = 0  # degraded mode: what was known to be spent (ledger, Redis) when it began
    # Degraded since this router started (it never reached Redis): it grants no budget at all. What
    # it granted before a restart is not known to it, and each restart took a fresh share (seen:
    # four restarts, +42.9 % over a 6,000-token budget).
    unseen: bool = False

    def __post_init__(self) -> None:
        if self.limits.requests_per_minute:
            self.requests = Bucket(float(self.limits.requests_per_minute))
        if self.limits.tokens_per_minute:
            self.tokens = Bucket(float(self.limits.tokens_per_minute))

    def ledger_used(self, period: float) -> int:
        """What the ledger says was used in the period starting at ``period`` (0: not known)."""
        return self.ledger[1] if self.ledger[0] == period else 0

    def spent(self) -> int:
        """Tokens this period counts as used: the most that is known (what this router settled,
        or what every router reported), or in degraded mode what this router granted of its share."""
        return self.used if self.share is not None else max(self.used, self.ledger_used(self.period))


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: the client's message, Retry-After and OpenAI's headers."""

    message: str
    retry_after: float
    headers: dict[str, str] = field(default_factory=dict)
    fits_never: bool = False  # the request alone exceeds a limit: waiting cannot help (a 400)
    unavailable: bool = False  # the limits could not be checked (a 503): not the tenant's doing
    kind: str = "requests"  # which limit: requests, tokens, concurrent, budget (the answer's error type)


def refusal(limits: Limits, why: str, retry_after: float, requests_left: float | None,
            tokens_left: float | None, *, kind: str = "requests", budget_left: int | None = None) -> Refusal:
    """The 429's message and OpenAI's headers, from what is left in each bucket (None: unknown, full).
    A budget's refusal gives the budget's figures in the token headers (seen: a spent budget
    answered with the request headers only, and "type": "requests")."""
    headers: dict[str, str] = {}
    for bucket, cap, left in (("requests", limits.requests_per_minute, requests_left),
                              ("tokens", limits.tokens_per_minute, tokens_left)):
        if cap:
            level = float(cap) if left is None else left
            headers[f"x-ratelimit-limit-{bucket}"] = str(cap)
            headers[f"x-ratelimit-remaining-{bucket}"] = str(max(0, math.floor(level)))
            headers[f"x-ratelimit-reset-{bucket}"] = duration(max(0.0, (cap - level) * 60.0 / cap))
    if limits.budget is not None and budget_left is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.budget.tokens)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, budget_left))
        headers["x-ratelimit-reset-tokens"] = duration(max(0.0, retry_after))
    return Refusal(f"Rate limit reached: {why}. Retry in {duration(retry_after)}.", max(0.0, retry_after), headers,
                   kind=kind)


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: 20ms, 1s, 6m0s, 2h3m4s. Rounded up from the microsecond:
    a float's last bit (5.000000001 s, the Lua and the Python arithmetic apart) is not a second."""
    seconds = round(seconds, 6)
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"


def check(s: Scope, reserve: int, now: float, *, routers: int = 1) -> Refusal | None:
    """Whether a request reserving ``reserve`` tokens fits scope ``s`` at ``now``: None, or why not.
    Takes nothing; refills the buckets and turns the budget's period over (a new period: what was
    used before no longer counts; in degraded mode, this router's share of the new one among
    ``routers``)."""
    lim = s.limits
    # Refilled first: any refusal's headers say what the buckets have now (a concurrency refusal
    # said what they had at the last request).
    if s.requests is not None:
        s.requests.refill(now)
    if s.tokens is not None:
        s.tokens.refill(now)
    if lim.concurrent is not None and s.inflight >= lim.concurrent:
        return _refused(s, "concurrent", reserve=reserve, inflight=s.inflight)
    if s.requests is not None and s.requests.level < 1:
        return _refused(s, "requests", reserve=reserve, wait=s.requests.wait(1))
    if s.tokens is not None and reserve > 0:  # a request that takes no tokens waits out no debt of them
        need = reserve if reserve < s.tokens.capacity else s.tokens.capacity  # at most the whole bucket
        if s.tokens.level < need:
            return _refused(s, "tokens", reserve=reserve, wait=s.tokens.wait(need))
    b = lim.budget
    if b is not None:
        if reserve > b.tokens:
            return never_fits((s,), reserve)
        start = period_start(b, now)
        if start != s.period:
            # A new period: what was used and reserved before no longer counts. A request admitted
            # in the old one is charged to it (settle), as Redis charges it to the old period's key.
            s.period, s.used, s.reserved = start, 0, 0
            if s.share is not None and not s.unseen:  # degraded across the reset: a share of the new period
                s.base = s.ledger_used(start)
                s.share = max(0, b.tokens - s.base) // routers
        # s.spent(), written out: this runs twice on every request with a budget.
        spent = s.used if s.share is not None else max(s.used, s.ledger[1] if s.ledger[0] == s.period else 0)
        # A request that reserves nothing is not refused by the budget (nor by the tokens bucket):
        # it takes none of it, as the shared limits' script asks nothing of a limit it takes nothing of.
        if reserve > 0 and spent + s.reserved + reserve > (b.tokens if s.share is None else s.share):
            alone = "" if s.share is None else (
                "; this router started while the routers cannot share limits (Redis away): it grants no "
                "budget until Redis answers" if s.unseen else
                f"; while the routers cannot share limits (Redis away) this router may grant {s.share} of "
                f"the {max(0, b.tokens - s.base)} left, its share of {routers} routers")
            return _refused(s, "budget", reserve=reserve, used=spent if s.share is None else s.base + spent,
                           reserved=s.reserved, resets=next_period(b, now), now=now, note=alone)
    return None


def _refused(s: Scope, kind: Kind, **given: Any) -> Refusal:
    """:func:`refused` with what the scope's own buckets have left (an in-memory scope's)."""
    return refused(s, kind, requests_left=None if s.requests is None else s.requests.level,
                   tokens_left=None if s.tokens is None else s.tokens.level, **given)


def take(s: Scope, reserve: int) -> None:
    """A request admitted (every scope it falls in :func:`check`-ed first): it takes a request, its
    reservation of tokens (the bucket may go below zero: the next requests wait for it) and a slot."""
    if s.requests is not None:
        s.requests.level -= 1
    if s.tokens is not None:
        s.tokens.level -= reserve
    s.inflight += 1
    s.reserved += reserve


def settle(s: Scope, reserved: int, tokens: int, period: float, now: float) -> None:
    """A request admitted in the budget period starting at ``period`` that reserved ``reserved``
    used ``tokens``, at ``now``: the reservation is replaced by them (in that period; once another
    began, they count in none the scope still checks)."""
    if period == s.period:
        s.reserved -= reserved
        s.used += tokens
    if s.tokens is not None:
        # Refilled to now first: a full bucket refills no more, and a debt taken from it later
        # must not be refilled for the time it was full (Redis's script reads it so).
        s.tokens.refill(now)
        # The bucket was charged the reservation: give back what was not used, or take the
        # excess (it may go below zero: the next requests wait for it).
        s.tokens.level = min(s.tokens.capacity, s.tokens.level + reserved - tokens)


def end(s: Scope) -> None:
    """A request admitted to ``s`` ended (settled first)."""
    s.inflight -= 1


def never_fits(scopes: Iterable[Scope], reserve: int) -> Refusal | None:
    """A refusal when ``reserve`` alone exceeds a scope's whole budget: waiting cannot help (a 400)."""
    for s in scopes:
        b = s.limits.budget
        if b is not None and reserve > b.tokens:
            return Refusal(f"This request reserves {reserve} tokens (the largest of its max_tokens, "
                           "max_completion_tokens and n_predict, times its answers, plus its prompt), more than "
                           f"tenant `{s.name}`'s whole budget of {b.tokens} per {b.per}: lower max_tokens.", 0.0,
                           fits_never=True)
    return None


def refused(s: Scope, kind: Kind, *, reserve: int, wait: float = 1.0, inflight: int = 0, used: int = 0,
            reserved: int = 0, resets: float = 0.0, now: float = 0.0, note: str = "",
            requests_left: float | None = None, tokens_left: float | None = None,
            held: bool = False) -> Refusal:
    """The refusal of a request by scope ``s``'s limit of ``kind``, worded once for both limiters.
    ``wait``: seconds until it may fit (a budget: until ``resets``); ``inflight``: requests in
    flight (concurrent); ``used``, ``reserved``: the budget's counts; ``held``: ``reserved``
    includes what routers hold (shared limits); ``requests_left``, ``tokens_left``: what the
    buckets have (None: not known, counted as full)."""
    lim = s.limits
    budget_left = None
    if kind == "concurrent":
        why = f"{inflight} requests of tenant `{s.name}` are in flight, its limit (concurrent: {lim.concurrent})"
    elif kind == "requests":
        why = f"tenant `{s.name}` reached its limit of {lim.requests_per_minute} requests per minute"
    elif kind == "tokens":
        why = f"tenant `{s.name}` reached its limit of {lim.tokens_per_minute} tokens per minute " \
              f"(this request reserves {reserve})"
    else:
        b = lim.budget
        assert b is not None
        wait = resets - now
        by = "requests in flight or held by routers" if held else "requests in flight"
        why = (f"tenant `{s.name}` has used {used} of its {b.tokens}-token budget per {b.per} (this request "
               f"reserves {reserve}, {reserved} are reserved by {by}{note}); it resets at {_when(resets)}")
        budget_left = b.tokens - used - reserved
    return refusal(lim, why, wait, requests_left, tokens_left, kind=kind, budget_left=budget_left)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M UTC")
