"""Tenants' limits shared by several router processes, in Redis (issue 18).

The same rules as :mod:`llmgw.tenancy.rules` applies in memory (buckets that refill continuously, requests in
flight, a budget per period with reservations settled from real usage), kept in Redis, where
one Lua script makes every check-and-take atomic for all routers. Keys:
``llmgw:limits:<tenant>[/<model>]:{rpm,tpm,inflight,budget:<period start>}``.

**Allowances.** A router does not ask Redis for every request: it takes an allowance of each
limit (never more than is left) and admits from it locally, so one script call serves many
requests. A request the allowance cannot cover claims what is there and asks Redis for the
rest in its own grant step (one step per scope also tops the allowance up), so what a router
admits is always what Redis granted it. The top-up is sized by the router's own use: the first
request of a scope after a while asks for a twentieth of each limit (:data:`CHUNK_SHARE`), later
ones for :data:`GRANT` times what its requests took of the scope in the last :data:`KEEP`
seconds (at that pace, if they began less than KEEP seconds ago), never more than a twentieth.
Every :data:`SYNC_EVERY` seconds (and at close) it gives back what it holds beyond :data:`HOLD`
times that (down to GRANT times; everything once its requests took nothing for KEEP seconds;
of slots, all but a twentieth of the concurrency limit, which how many requests come says
nothing about), and reports the budget tokens its finished requests used (with what it gives
back, else every :data:`REPORT_EVERY` seconds). A tenant's few requests a second on a router
are thus admitted from one grant for several seconds (issue 35: given back at every quarter
second, a tenant at hundreds of requests a minute went to Redis twice a request, and the
routers served half of what they did with limits off). What this costs in exactness, and only
for limits above 20 (smaller ones are asked for request by request): another router may be
refused for up to KEEP + SYNC_EVERY seconds while this one holds an unused allowance, at most
HOLD times what its own requests took in KEEP seconds and a twentieth of the limit. Nothing is
ever admitted beyond a limit: an allowance is taken from what is left, in one atomic step, so a
budget is overshot only by a request that uses more than it reserved.

**Leases.** What a router holds is written down under its instance, with a lease of
:data:`LEASE` seconds renewed by each of its calls (and every :data:`HEARTBEAT` while its
requests are in flight). A router killed, or cut off from Redis, gives back nothing itself: the
first call of any router after its lease ran out gives back what it held. What it costs: the
budget tokens its requests used since it last reported them (REPORT_EVERY at most) are not
counted as used, and a router that stalls past its lease with requests in flight may see their
reservations granted again.

Degraded mode: when Redis does not answer within :data:`TIMEOUT` (a connection refused or
reset, a timeout: Redis away), the router applies the limits with its own in-memory
:class:`~llmgw.tenancy.memory.Limiter`, says so in ``llmgw_router_limits_degraded`` and in its
log, and tries Redis again after :data:`RETRY_AFTER`. It never lets a tenant through unlimited,
and never grants a fresh budget: each budget goes on from what was known to be spent (the
ledger's figure, or what Redis last said, whichever is more), and this router grants only its
share of what was left (divided among the routers the controller knows of). Rates and
concurrency are each router's own meanwhile (each allows the whole limit on its share of the
traffic).

Anything else that goes wrong with a call (the script raising, a reply that does not parse) is
not "Redis away": it is a bug, and treating it as an outage would silently turn N routers into
N times every limit. It is logged with its traceback, counted in
``llmgw_router_limits_errors_total``, and the requests that needed Redis are refused with a 503
(fail closed) until calls succeed again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmgw.redact import redact
from llmgw.tenancy.memory import Limiter, ScopedLimits, Ticket
from llmgw.tenancy.rules import Counts, Kind, Refusal, Scope, next_period, period_start, refused, takes
from llmgw.tenancy.script import STEPS, give_back_part, grant_part

log = logging.getLogger(__name__)

TIMEOUT = 0.25       # seconds Redis gets per call before the router goes it alone
RETRY_AFTER = 5.0    # seconds before a degraded router tries Redis again
SYNC_EVERY = 1.0     # seconds between a router's syncs (what it gives back, what its requests used)
CHUNK_SHARE = 20     # an allowance is at most 1/CHUNK_SHARE of its limit
# An allowance is sized by its router's own use (see the module's docstring): a top-up asks for
# GRANT times what requests took of the scope in the last KEEP seconds, a sync gives back what
# is beyond HOLD times that.
KEEP = 5.0
GRANT = 2
HOLD = 3
REPORT_EVERY = 5.0   # seconds at most before used budget tokens are reported, if nothing goes back
LEASE = 15.0         # seconds a router's holdings outlive its last call to Redis
HEARTBEAT = 3.0      # seconds between calls that renew the lease while requests are in flight
# Script calls one router has under way at once: each carries every step queued while the
# other was out, so requests that need Redis at the same time share a round trip.
CALLS_IN_FLIGHT = 1
# Times a request waits for other requests' grants before it asks for its own.
WAITS = 2

_STEPS = STEPS  # the script registered by each SharedLimits (a test swaps it for a broken one)

ERROR_LOG_EVERY = 60.0  # seconds between tracebacks of the same kind of failed call (each is counted)
# Seconds a refusal from Redis is answered again before a body is read (``precheck``): what the
# refusal said to wait, and for limits above CHUNK_SHARE never longer than this (allowances other
# routers give back may free them sooner); a budget spent to the last token, a minute at a time.
REFUSAL_MEMORY = 1.0


class Cancellable(Protocol):
    def cancel(self) -> None: ...


Timer = Callable[[float, Callable[[], None]], Cancellable]  # (delay in seconds, callback) -> a handle


def _call_later(delay: float, callback: Callable[[], None]) -> Cancellable:
    return asyncio.get_running_loop().call_later(delay, callback)


class LimitsBroken(Exception):
    """A call to Redis failed with anything but Redis being away: a script error, a bad reply."""


class PeriodMoved(Exception):
    """Redis's clock is in another budget period than the router's: asked again with Redis's time."""


@dataclass
class Pending:
    """A step queued for the next script call. A grant also says who waits for its answer, and
    what of it is that request's own (``needs``, per allowance); the rest tops the allowances up.
    ``abandoned``: the request is gone, all of it goes to the allowances."""

    step: list[Any]
    answer: asyncio.Future[Any] | None = None
    allowances: list[Allowance] | None = None
    needs: list[Counts] | None = None
    abandoned: bool = False


def redacted(url: str) -> str:
    """``url`` without its password, for logs and metrics (the one redaction, llmgw.redact)."""
    return redact(url)


def chunk(limit: int | None) -> int:
    """A twentieth of a limit (at least 1): the most an allowance asks for at once."""
    return max(1, (limit or 0) // CHUNK_SHARE)


def keep_syncs() -> int:
    """The syncs in KEEP seconds."""
    return max(1, round(KEEP / SYNC_EVERY))


def kept(have: int, pace: int) -> int:
    """What a sync keeps of one count (requests, tokens or budget tokens) of an allowance that
    holds ``have`` when its requests take ``pace`` of it in KEEP seconds: all of it up to HOLD
    times that, else GRANT times that (what a top-up asks for: the slack between the two keeps
    a steady pace from giving back and asking again); nothing once they took none for KEEP
    seconds, and a debt (below 0) is settled."""
    if have <= 0:
        return 0
    return have if have <= HOLD * pace else GRANT * pace


def kept_slots(have: int, pace: int, concurrent: int | None) -> int:
    """What a sync keeps of an allowance's slots (requests in flight): while requests come, up to
    a twentieth of the concurrency limit. How many came says nothing of how many ran at once, and
    slots held idle are what another router's requests would run in."""
    if have <= 0 or pace <= 0:
        return 0
    return min(have, chunk(concurrent))


@dataclass
class Allowance:
    """What this router holds of one scope's limits in Redis, to admit from without asking.
    A count may go below zero (a request that used more tokens than it reserved): a debt,
    settled at the next sync."""

    key: str
    scope: Scope
    period: str = "0"
    # The budget period's bounds on Redis's clock (a scope without a budget: always the one).
    period_from: float = -math.inf
    period_end: float = math.inf
    requests: int = 0
    tokens: int = 0
    budget: int = 0
    slots: int = 0
    used: int = 0  # budget tokens finished requests used, not reported yet (in Redis still as reserved)
    # Budget tokens reserved and slots taken by requests admitted from here and not ended (in Redis
    # as this router's holdings): what it declares again to a Redis that lost its data.
    out: int = 0
    out_slots: int = 0
    # Budget tokens unspent here when Redis last answered: what this router may spend from its
    # allowance after Redis went away (no ledger figure counts it), taken off its degraded share.
    held_at_call: int = 0
    # What requests took of each count since the last sync, in each sync's time before it (KEEP
    # seconds' worth, oldest first; emptied once they took nothing in all that time), and the
    # sum of those: what a top-up asks for and a sync keeps is sized by them (:meth:`pace`).
    recent: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    earlier: deque[Counts] = field(default_factory=deque)
    window: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    heir: Allowance | None = None  # the next budget period's, which took the counts not kept by period
    overdrawn: bool = False  # a request used beyond what was held: the budget is asked of Redis until it grants

    @property
    def exact(self) -> bool:
        """Whether this scope's buckets are asked of Redis request by request (each a chunk of 1:
        limits under twice CHUNK_SHARE), so nothing of them is held here."""
        lim = self.scope.limits
        return chunk(lim.requests_per_minute) == 1 and chunk(lim.tokens_per_minute) == 1

    def request(self, reserve: int) -> Counts:
        """What one request of ``reserve`` tokens takes of each limit: requests, tokens, budget, slots.
        (Tokens per minute: at most the whole bucket; a bigger request leaves a debt, as in memory.)"""
        return takes(self.scope.limits, reserve)

    def fits(self, reserve: int) -> bool:
        """Whether this allowance has all :meth:`request` takes (written out: on every request)."""
        lim = self.scope.limits
        tpm = lim.tokens_per_minute
        return ((not lim.requests_per_minute or self.requests >= 1)
                and (not tpm or self.tokens >= (reserve if reserve < tpm else tpm))
                and (lim.budget is None or self.budget >= reserve)
                and (not lim.concurrent or self.slots >= 1))

    def claim(self, wanted: Counts) -> Counts:
        """Take what this allowance has of ``wanted`` (all of it, or part of one count); returns that."""
        have = (max(0, min(self.requests, wanted[0])), max(0, min(self.tokens, wanted[1])),
                max(0, min(self.budget, wanted[2])), max(0, min(self.slots, wanted[3])))
        self.add(have, -1)
        return have

    def add(self, counts: Counts | list[int], sign: int = 1) -> None:
        self.requests += sign * counts[0]
        self.tokens += sign * counts[1]
        self.budget += sign * counts[2]
        self.slots += sign * counts[3]

    def take(self, reserve: int) -> None:
        """One request admitted from here (what :meth:`fits` said it has): :meth:`request`'s
        counts taken and noted in ``recent``, and a request bigger than the tokens-per-minute
        bucket takes the rest as a debt (:meth:`owe`). Written out: on every request."""
        lim = self.scope.limits
        recent = self.recent
        if lim.requests_per_minute:
            self.requests -= 1
            recent[0] += 1
        tpm = lim.tokens_per_minute
        if tpm:
            self.tokens -= reserve
            recent[1] += reserve if reserve < tpm else tpm
        if lim.budget is not None:
            self.budget -= reserve
            recent[2] += reserve
            self.out += reserve
        if lim.concurrent:
            self.slots -= 1
            recent[3] += 1
            self.out_slots += 1

    def took(self, counts: Counts) -> None:
        """One request admitted with ``counts`` claimed from here and granted by Redis."""
        recent = self.recent
        recent[0] += counts[0]
        recent[1] += counts[1]
        recent[2] += counts[2]
        recent[3] += counts[3]
        self.out += counts[2]
        self.out_slots += counts[3]

    def owe(self, reserve: int) -> None:
        """A request bigger than the tokens-per-minute bucket takes it below zero (given back as a debt)."""
        tpm = self.scope.limits.tokens_per_minute
        if tpm and reserve > tpm:
            self.tokens -= reserve - tpm

    def end(self, reserved: int, used: int) -> Allowance:
        """A request admitted from here ended having used ``used`` of its ``reserved`` tokens; the
        allowance its tokens and slot went back to (this one, or a later period's)."""
        lim = self.scope.limits
        if lim.budget:
            self.budget += reserved - used
            self.used += used
            self.out -= reserved
        heir = self
        while heir.heir is not None:
            heir = heir.heir
        if lim.tokens_per_minute:
            heir.tokens += reserved - used
        if lim.concurrent:
            heir.slots += 1
            heir.out_slots -= 1
        return heir

    def hand_over(self, new: Allowance) -> None:
        """A new budget period's allowance of the same scope takes what is not counted by period:
        the requests, tokens and slots held, and the slots of requests in flight (they end into it)."""
        new.requests, new.tokens, new.slots, new.out_slots = self.requests, self.tokens, self.slots, self.out_slots
        self.requests = self.tokens = self.slots = self.out_slots = 0
        self.heir = new

    def pace(self) -> list[int]:
        """What requests take of each count in KEEP seconds, at the pace they took it in the last
        KEEP seconds (or since they began, if later: a tenant that starts is not taken for one
        that stops)."""
        w, r = self.window, self.recent
        syncs = keep_syncs()
        spans = len(self.earlier) + 1
        return [(w[0] + r[0]) * syncs // spans, (w[1] + r[1]) * syncs // spans,
                (w[2] + r[2]) * syncs // spans, (w[3] + r[3]) * syncs // spans]

    def wants(self) -> list[int]:
        """What a grant that tops this allowance up asks for in all, per count: GRANT times what
        its requests take in KEEP seconds (:meth:`pace`), at most a chunk of the limit; a chunk
        when they took nothing (the first request after a while, perhaps of a burst)."""
        lim = self.scope.limits
        chunks = (chunk(lim.requests_per_minute), chunk(lim.tokens_per_minute),
                  chunk(lim.budget.tokens if lim.budget else 0), chunk(lim.concurrent))
        return [min(c, GRANT * p) if p > 0 else c for c, p in zip(chunks, self.pace(), strict=True)]

    @property
    def quiet(self) -> bool:
        """Nothing held, nothing to report, and no request took anything for KEEP seconds."""
        return not (self.requests or self.tokens or self.budget or self.slots or self.used or self.earlier
                    or any(self.recent))

    def give_back(self, everything: bool, report: bool = True) -> list[Any] | None:
        """This allowance's part of a sync (what it gives back, and the budget tokens finished
        requests used), or None when there is nothing to say. Kept back (not ``everything``): see
        :func:`kept`, so a router under steady load, even a few requests a second, does not give
        back and ask again at every sync, and one idle for KEEP seconds holds nothing after the
        next sync. What was used is said with what is given back, or when ``report``; else it
        waits for the next part."""
        if self.quiet:
            return None
        lim = self.scope.limits
        have = (self.requests, self.tokens, self.budget if lim.budget else 0, self.slots)
        pace = self.pace()
        self._age()
        keep = (0, 0, 0, 0) if everything else (kept(have[0], pace[0]), kept(have[1], pace[1]), kept(
            have[2], pace[2]), kept_slots(have[3], pace[3], lim.concurrent))
        given = (have[0] - keep[0], have[1] - keep[1], have[2] - keep[2], have[3] - keep[3])
        used = self.used if lim.budget else 0
        if not any(given) and not (used and report):
            return None
        self.requests, self.tokens, self.budget, self.slots = keep
        self.used = 0
        return give_back_part(lim, period=self.period, given=given, used=used)

    def _age(self) -> None:
        """A sync: what requests took since the last one joins the window, the oldest leaves it."""
        recent, window, earlier = self.recent, self.window, self.earlier
        if any(recent):
            earlier.append((recent[0], recent[1], recent[2], recent[3]))
            for i in range(4):
                window[i] += recent[i]
            self.recent = [0, 0, 0, 0]
        else:
            earlier.append((0, 0, 0, 0))
        while len(earlier) >= keep_syncs():
            old = earlier.popleft()
            for i in range(4):
                window[i] -= old[i]
        if not any(window):
            earlier.clear()

    @property
    def spent_since_call(self) -> int:
        """Budget tokens taken from here since Redis last answered (reservations of requests in
        flight included), at most what it held then."""
        return max(0, self.held_at_call - max(0, self.budget))

    @property
    def holds(self) -> bool:
        return bool(self.requests or self.tokens or self.budget or self.slots)


class SharedTicket:
    """A request admitted from this router's allowances; its end goes back to them (at most once)."""

    __slots__ = ("_owner", "_allowances", "_reserved", "_used", "_released", "_floor")

    def __init__(self, owner: SharedLimits, allowances: list[Allowance], reserved: int) -> None:
        owner.in_flight += 1
        self._owner = owner
        self._allowances = allowances
        self._reserved = reserved
        self._used: int | None = None
        self._released = False
        self._floor = 0

    def settle(self, tokens: int) -> None:
        if self._used is None:
            self._used = tokens if tokens > 0 else 0

    def charge_at_least(self, tokens: int) -> None:
        """What the request is charged if it ends unsettled (as :meth:`Ticket.charge_at_least`)."""
        if tokens > self._floor:
            self._floor = tokens

    def release(self) -> None:
        """The request ended; unsettled, it is charged :meth:`charge_at_least`'s figure (0: it
        reached no engine)."""
        if self._released:
            return
        self._released = True
        used = self._floor if self._used is None else self._used
        reserved = self._reserved
        owner = self._owner
        for a in self._allowances:
            heir = a.end(reserved, used)
            # A limit asked of Redis request by request holds nothing of its buckets here: what
            # the request did not use (or used beyond its reservation) goes to Redis now, whose
            # bucket refills meanwhile as the in-memory one would with it (held until a sync, the
            # two made the sum overflow the bucket or fall short of it: the differential test).
            if heir.exact and heir.tokens:
                owner.give_back_now(heir)
            if a.budget < 0 or (a.overdrawn and a.budget):
                # Used beyond what it held of the budget: counted before the next grant, and what
                # it holds of the budget goes back too until a grant finds room again (held, it
                # admitted a request the in-memory limits refused, the budget spent: 50 of 43).
                a.overdrawn = True
                owner.give_back_now(a)
        owner.in_flight -= 1
        if owner._sync is None or owner._beat is None:  # noqa: SLF001 - SharedLimits.ended, written out
            owner.schedule_sync()


class SharedLimits(ScopedLimits):
    """The limits of a :class:`Limiter` (its tenants and scopes), counted in Redis at ``url``."""

    def __init__(self, url: str, *, limiter: Limiter | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, on_error: Callable[[str], None] | None = None,
                 server_clock: Callable[[], float] | None = None, timer: Timer | None = None) -> None:
        """``clock``: this router's own, for how long Redis is left alone and refusals remembered;
        ``wall``: the time of day, for naming budget periods; ``server_clock``: what the script runs
        by instead of the Redis server's own time (None in every router: one clock for all of them);
        ``timer``: how syncs and heartbeats are scheduled (the event loop's ``call_later``). A test
        passes all four to drive this limiter and the in-memory one by one clock it moves itself."""
        import redis.asyncio as redis  # only routers configured with Redis load the client
        import redis.exceptions as errors

        super().__init__(limiter)
        self.url = url
        # Redis away: what degraded mode is for. Anything else is a bug, refused loudly (_broken).
        self._away: tuple[type[Exception], ...] = (errors.ConnectionError, errors.TimeoutError, TimeoutError,
                                                       OSError)
        self._on_error = on_error
        self._error_logged: dict[str, float] = {}
        # Redis's clock minus this router's (``wall``), from the last reply: periods are named by it.
        self.offset = 0.0
        # Scope name -> (budget period, tokens used and reserved) as Redis last said: where degraded
        # mode starts from when Redis goes away.
        self._known: dict[str, tuple[float, int]] = {}
        # Scope name -> (until, and when its wait ends, on this router's clock; the refusal; the
        # limits it was for; the least a request must reserve for it to hold).
        self._refused: dict[str, tuple[float, float, Refusal, Any, int]] = {}
        self.instance = secrets.token_hex(8)  # whose holdings these are, in Redis
        self._epoch = ""  # the Redis data's epoch its allowances came from (llmgw.tenancy.script)
        self.lost_data = 0  # times Redis was found to have lost the data this router held allowances of
        self.in_flight = 0  # requests admitted from allowances and not ended
        self._redis = redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        self._clock = clock
        self._wall = wall
        self._server_clock = server_clock
        self._timer: Timer = timer or _call_later
        self._down_until = 0.0
        self.degraded = False
        # Redis answered this process at least once (a ping at start, then any call): a router that
        # never reached it since it started takes no share of a budget while it is away.
        self._answered = False
        self._hello: asyncio.Task[None] | None = None
        try:
            self._hello = asyncio.get_running_loop().create_task(self._say_hello(), name="llmgw-limits-hello")
        except RuntimeError:
            pass  # made outside an event loop (a test): the first call says it
        self._steps = self._redis.register_script(_STEPS)
        self._allowances: dict[tuple[str, str], Allowance] = {}  # (scope name, budget period)
        self._current: dict[str, Allowance] = {}  # scope name -> the allowance of its period last asked for
        self._syncs = 0
        self._grants: dict[str, asyncio.Future[Any]] = {}  # scope name -> a grant under way
        self._queue: list[Pending] = []
        self._calls: set[asyncio.Task[None]] = set()
        self._kick_scheduled = False
        self._sync: Cancellable | None = None
        self._beat: Cancellable | None = None
        self._retired: list[Allowance] = []  # of an ended period or old limits, to give back
        # Scope name -> budget tokens taken from allowances since Redis last answered, of those dropped.
        self._taken_alone: dict[str, int] = {}

    async def admit(self, key: str, models: tuple[str, ...], reserve: int,
                    now: float) -> Ticket | SharedTicket | Refusal | None:
        """As :meth:`Limiter.admit`, counted in Redis; in memory while Redis cannot be reached;
        a 503 refusal (``unavailable``) when a call failed for another reason."""
        limiter = self.limiter  # the catalog's when the request came (a new one may come meanwhile)
        scopes = limiter.scopes_of(key, models)
        if scopes is None:
            return None
        for s in scopes:  # Limiter.never_fits, written out: this runs on every request
            b = s.limits.budget
            if b is not None and reserve > b.tokens:
                return limiter.never_fits(scopes, reserve)
        now += self.offset  # periods by Redis's clock
        if self._down_until and self._clock() < self._down_until:
            return self._alone(limiter, key, models, reserve, now)
        # The usual case, without a wait: every allowance has what the request takes.
        allowances = []
        current = self._current
        for s in scopes:
            a = current.get(s.name)  # _allowance's own first step, written out
            if a is None or a.scope is not s or not a.period_from <= now < a.period_end:
                a = self._allowance(s, now)
            allowances.append(a)
        for a in allowances:
            if not a.fits(reserve):
                break
        else:
            for a in allowances:
                a.take(reserve)
            return SharedTicket(self, allowances, reserve)
        for _ in range(2):
            got = await self._admit(limiter, scopes, reserve, now)
            if not isinstance(got, PeriodMoved):
                break
            now = float(got.args[0])  # the period Redis is in, by its own time (at most once more)
        if isinstance(got, PeriodMoved):
            return Refusal("Rate limit reached: the budget period is changing over; retry in a second.", 1.0)
        if isinstance(got, LimitsBroken):
            return Refusal("The tenants' limits could not be checked (the limits store failed: see the router's "
                           "log); retry shortly.", 1.0, unavailable=True)
        if isinstance(got, Exception):  # Redis away: this router limits alone meanwhile
            return self._alone(limiter, key, models, reserve, now)
        return got

    def precheck(self, key: str, reserve: int, now: float) -> Refusal | None:
        """As :meth:`Limiter.precheck`, before the body is read: in degraded mode from the local
        counts; else from what Redis last refused this tenant (it is not asked: that is a round
        trip a hostile tenant's every request would cost), so a tenant over its limits is refused
        without its body being read or parsed."""
        limiter = self.limiter
        if self._down_until and self._clock() < self._down_until:
            now += self.offset
            if not limiter.degraded:
                limiter.degrade(self._known, now, unseen=not self._answered, spent=self._spent_alone())
            return limiter.precheck(key, reserve, now)
        s = limiter.tenant_scope(key)
        if s is None:
            return None
        b = s.limits.budget
        if b is not None and reserve > b.tokens:
            return limiter.never_fits((s,), reserve)
        known = self._refused.get(s.name)
        if known is None:
            return None
        until, retry_at, refused, limits, least = known
        clock = self._clock()
        if clock >= until or limits != s.limits:
            del self._refused[s.name]
            return None
        if reserve < least:  # a smaller request may fit where the refused one did not: Redis says
            return None
        return Refusal(refused.message, max(0.0, retry_at - clock), refused.headers, kind=refused.kind)

    def _remember(self, s: Scope, refused: Refusal, kind: str, used: int, reserve: int) -> None:
        """A refusal of Redis's that holds for a while: for any request (requests per minute, a
        budget spent to the last token), or (tokens per minute, a budget nearly spent) for those
        that reserve at least ``reserve``, what the refused one did: a smaller one may fit."""
        least = 0 if kind == "requests" else reserve
        if kind in ("requests", "tokens"):
            limit = s.limits.requests_per_minute if kind == "requests" else s.limits.tokens_per_minute
            # A limit asked for request by request (no allowances to come back) refills with time
            # alone: the wait Redis said is exact.
            keep = refused.retry_after if (limit or 0) <= CHUNK_SHARE else min(refused.retry_after, REFUSAL_MEMORY)
        elif kind == "budget" and s.limits.budget is not None and used >= s.limits.budget.tokens:
            keep = min(refused.retry_after, 60.0)  # spent to the last token: asked again each minute
            least = 0
        else:
            return
        if len(self._refused) > 4096:
            self._refused.clear()
        clock = self._clock()
        self._refused[s.name] = (clock + keep, clock + refused.retry_after, refused, s.limits, least)

    def _alone(self, limiter: Limiter, key: str, models: tuple[str, ...], reserve: int,
               now: float) -> Ticket | Refusal | None:
        """Degraded mode: in memory, each budget from this router's share of what was left."""
        if not limiter.degraded:
            limiter.degrade(self._known, now, unseen=not self._answered, spent=self._spent_alone())
        return limiter.admit(key, models, reserve, now)

    async def _admit(self, limiter: Limiter, scopes: tuple[Scope, ...], reserve: int,
                     now: float) -> SharedTicket | Refusal | Exception:
        allowances = [self._allowance(s, now) for s in scopes]
        for _ in range(WAITS):
            if all(a.fits(reserve) for a in allowances):
                for a in allowances:
                    a.take(reserve)
                return SharedTicket(self, allowances, reserve)
            # A grant under way for another request may top the allowances up enough for this
            # one too (checked again after the wait: others may have taken it meanwhile).
            waiting = {id(f): f for a in allowances if (f := self._grants.get(a.scope.name)) is not None}
            if not waiting:
                break
            await asyncio.wait(list(waiting.values()))
        return await self._grant(limiter, allowances, reserve, now)

    def _allowance(self, s: Scope, now: float) -> Allowance:
        a = self._current.get(s.name)  # asked on every request: the one in hand while its period lasts
        if a is not None and a.scope is s and a.period_from <= now < a.period_end:
            return a
        b = s.limits.budget
        period = str(int(period_start(b, now))) if b else "0"
        a = self._allowances.get((s.name, period))
        if a is None or a.scope is not s:
            # A new period, or new limits from a new catalog: start from nothing. What the old
            # allowance holds goes back at the next sync, to its own keys, and what its requests
            # in flight give back later goes too (it stays retired until they end). Of a period's
            # turn, what is not the budget's (requests, tokens, slots: not counted by period) is
            # the new allowance's at once: given back later, a slot the old one held unused
            # refused a request the in-memory limits admitted (the differential test).
            new = Allowance(f"llmgw:limits:{s.name}", s, period)
            if b is not None:
                new.period_from, new.period_end = float(period), next_period(b, now)
            old = a if a is not None else self._current.get(s.name)
            if old is not None:
                if old.scope is s:
                    old.hand_over(new)
                self._allowances.pop((s.name, old.period), None)
                self._retired.append(old)
            self._allowances[(s.name, period)] = a = new
        self._current[s.name] = a
        return a

    async def _grant(self, limiter: Limiter, allowances: list[Allowance], reserve: int, now: float,
                     ) -> SharedTicket | Refusal | Exception:
        """This request's own grant: what the allowances have of it is claimed at once (no one
        else can take it meanwhile), the rest asked of Redis together with a top-up of each
        allowance (:meth:`Allowance.wants`); the answer's part for this request is its own,
        whoever runs first."""
        haves, needs, parts, owes = [], [], [], []
        for a in allowances:
            if a.tokens < 0 or a.budget < 0:
                # A request bigger than the tokens bucket left a debt here: Redis's bucket takes it
                # before this grant is checked (the same call), as the in-memory bucket went below
                # zero at once (else the grant was checked against a bucket that did not know of it).
                self.give_back_now(a)
        for a in allowances:
            # One grant under way per scope tops up; the others ask only for their own request.
            top_up = a.scope.name not in self._grants
            whole = a.request(reserve)
            have = a.claim(whole)
            need = (whole[0] - have[0], whole[1] - have[1], whole[2] - have[2], whole[3] - have[3])
            haves.append(have)
            needs.append(need)
            lim = a.scope.limits
            want = [max(n, w - left) if n and top_up else n for n, w, left in zip(
                need, a.wants(), (a.requests, a.tokens, a.budget, a.slots), strict=True)]
            # A request bigger than the tokens bucket: Redis's bucket goes into debt by the rest at
            # once, as the in-memory one does (owed here until a sync, Redis's bucket refilled to
            # the full meanwhile and forgot part of it: the differential test).
            owes.append(reserve - whole[1] if need[1] and reserve > whole[1] else 0)
            parts.append(grant_part(lim, period=a.period, need=need, want=want,
                                    floor=a.scope.ledger_used(float(a.period)),
                                    period_end=a.period_end if lim.budget else 0, owe=owes[-1]))
        if not any(any(n) for n in needs):  # all of it was here after all
            for a, have in zip(allowances, haves, strict=True):
                a.took(have)
                a.owe(reserve)
            return SharedTicket(self, allowances, reserve)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        for a in allowances:
            self._grants.setdefault(a.scope.name, answer)
        pending = Pending(["g", [a.key for a in allowances], parts], answer, allowances, needs)
        self._enqueue(pending)

        def unclaim(granted: bool) -> None:
            for a, have, need in zip(allowances, haves, needs, strict=True):
                a.add(have)
                if granted:
                    a.add(need)
            self.schedule_sync()

        try:
            result = await asyncio.shield(answer)
        except asyncio.CancelledError:
            # The request is gone: what it claimed goes back, and what Redis grants it, or
            # (answered already) granted it, goes to the allowances.
            answered = answer.done() and answer.exception() is None and int(answer.result()[0]) == 0
            pending.abandoned = not answer.done()
            unclaim(answered)
            raise
        except LimitsBroken as exc:  # logged and counted where it happened (_call)
            unclaim(False)
            return exc
        except self._away as exc:
            unclaim(False)
            self._went_down(exc)
            return exc
        finally:
            for a in allowances:
                if self._grants.get(a.scope.name) is answer:
                    del self._grants[a.scope.name]
        if self.degraded:
            self.degraded = False
            limiter.undegrade()
            log.warning("limits are shared again through Redis at %s", redacted(self.url))
        if int(result[0]) == 2:
            unclaim(False)
            return PeriodMoved(self._wall() + self.offset)
        if int(result[0]) != 0:
            unclaim(False)
            a = allowances[int(result[1]) - 1]
            scope = a.scope
            if result[2] == "budget":
                self._known[scope.name] = (float(a.period), int(result[6]) + int(result[7]))
            refused = _refusal(a, [str(x) for x in result], reserve, now)
            self._remember(scope, refused, str(result[2]), int(result[6]), reserve)
            return refused
        for a, have, need, owed in zip(allowances, haves, needs, owes, strict=True):
            a.took((have[0] + need[0], have[1] + need[1], have[2] + need[2], have[3] + need[3]))
            if need[2]:
                a.overdrawn = False  # Redis found room in the budget
            if not owed:
                a.owe(reserve)
        return SharedTicket(self, allowances, reserve)

    def _granted(self, pending: Pending, result: list[Any]) -> None:
        """A grant's answer: beyond what its request needs (all of it, the request gone), to the allowances."""
        if int(result[0]) != 0:
            return
        assert pending.allowances is not None and pending.needs is not None
        for a, need, got in zip(pending.allowances, pending.needs, result[1], strict=True):
            a.add(got)
            if not pending.abandoned:
                a.add(need, -1)
            if got[4] >= 0:
                self._known[a.scope.name] = (float(a.period), got[4] + got[5])
        self.schedule_sync()  # the requests it was for may be gone: it goes back unused

    def give_back_now(self, a: Allowance) -> None:
        """What ``a`` holds of its tokens bucket (all of it when ``a`` is exact, else only a debt),
        and a budget debt with what its requests used, go to Redis with the next call, not the
        next sync: what a request took beyond its reservation must be counted before the next
        grant is checked (seen: a budget spent to 50 of 43 granted again, its overuse unreported)."""
        tokens = a.tokens if a.exact or a.tokens < 0 else 0
        debt = a.budget if (a.budget < 0 or a.overdrawn) and a.scope.limits.budget else 0
        used = a.used if debt else 0
        if not (tokens or debt):
            return
        a.tokens -= tokens
        a.budget -= debt
        a.used -= used
        part = give_back_part(a.scope.limits, period=a.period, given=(0, tokens, debt, 0), used=used)
        self._enqueue(Pending(["y", [a.key], [part]]))

    def ended(self) -> None:
        """A request admitted from the allowances ended: what it did not use goes back to them, and to
        Redis with the syncs that follow once unused (:meth:`Allowance.give_back`)."""
        self.in_flight -= 1
        self.schedule_sync()

    def schedule_sync(self) -> None:
        if self._sync is None:
            self._sync = self._timer(SYNC_EVERY, self._send_sync)
        if self._beat is None:
            self._beat = self._timer(HEARTBEAT, self._heartbeat)

    def _heartbeat(self) -> None:
        """While its requests are in flight, a router renews its lease even when it has nothing to say."""
        self._beat = None
        if self.in_flight > 0:
            if not self._queue and not self._calls:
                self._enqueue(Pending(["y", [], []]))
            self._beat = self._timer(HEARTBEAT, self._heartbeat)

    def _send_sync(self, everything: bool = False) -> None:
        """Give back what the allowances will not need (``everything``: all of it) and report
        what finished requests used."""
        self._sync = None
        by_key: dict[str, list[Any]] = {}
        for a in self._retired:
            if (part := a.give_back(True)) is not None:
                by_key.setdefault(a.key, []).append(part)
        # A retired allowance is dropped once nothing it admitted is in flight: until then what
        # those requests give back and used is its to report (it was never reported, seen by a review).
        self._retired = [a for a in self._retired if a.out or a.out_slots]
        self._syncs += 1
        report = everything or self._syncs % max(1, round(REPORT_EVERY / SYNC_EVERY)) == 0
        kept = False
        for a in self._allowances.values():
            if (part := a.give_back(everything, report)) is not None:
                by_key.setdefault(a.key, []).append(part)
            kept = kept or not a.quiet
        if kept and not everything:
            self.schedule_sync()  # given back once unused, if no request takes it meanwhile
        if by_key:
            keys = [k for k, ps in by_key.items() for _ in ps]
            self._enqueue(Pending(["y", keys, [p for ps in by_key.values() for p in ps]]))

    def _enqueue(self, step: Pending) -> None:
        self._queue.append(step)
        if not self._kick_scheduled and len(self._calls) < CALLS_IN_FLIGHT:
            # After the callbacks already due: the steps other requests queue in this turn of
            # the loop go in the same call.
            self._kick_scheduled = True
            asyncio.get_running_loop().call_soon(self._kick)

    def _kick(self) -> None:
        self._kick_scheduled = False
        if self._queue and len(self._calls) < CALLS_IN_FLIGHT:
            steps, self._queue = self._queue, []
            task = asyncio.get_running_loop().create_task(self._call(steps))
            self._calls.add(task)
            task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        if self._queue and not self._kick_scheduled:
            self._kick()

    async def _say_hello(self) -> None:
        try:
            async with asyncio.timeout(TIMEOUT):
                await self._redis.ping()
            self._answered = True
        except Exception:  # noqa: BLE001 - away or not, the calls that matter say it themselves
            pass

    async def _call(self, steps: list[Pending]) -> None:
        """Send ``steps`` as one script call; hand each grant its answer."""
        payload = json.dumps([p.step for p in steps], separators=(",", ":"))
        grants = [p for p in steps if p.answer is not None]
        failed: BaseException | None = None
        try:
            # The epoch only while something is held: with nothing to lose, any epoch will do.
            epoch = self._epoch if self._allowances or self._retired else ""
            at = [] if self._server_clock is None else [repr(self._server_clock())]
            async with asyncio.timeout(TIMEOUT):
                reply = await self._steps(args=[payload, self.instance, LEASE, epoch, *at])
            lost = self._lost_epoch(reply)
            if lost is not None:  # Redis lost its data: what this router holds is declared, then the steps
                again = json.dumps([self._hold_again(steps), *(p.step for p in steps)], separators=(",", ":"))
                async with asyncio.timeout(TIMEOUT):
                    reply = await self._steps(args=[again, self.instance, LEASE, lost, *at])
                if self._lost_epoch(reply) is not None:
                    raise ValueError("Redis lost its data twice in one call")
            results = self._read(reply, grants)
        except self._away as exc:  # the waiting requests go local (degraded mode)
            self._went_down(exc)
            failed = exc
        except Exception as exc:  # noqa: BLE001 - not Redis away: a bug, logged with its traceback, counted, refused
            self._broken(exc)
            failed = LimitsBroken(f"{type(exc).__name__}: {exc}")
        if failed is None:
            self._answered = True
            self._taken_alone.clear()
        if failed is not None:
            # A call that failed may have run in Redis, wholly or in part (a script that raises
            # keeps what it wrote): what this router holds there is not known any more.
            self._forget_holdings()
            for p in steps:
                if p.answer is not None and not p.answer.done():
                    p.answer.set_exception(failed)
            return
        for p, result in zip(grants, results, strict=True):
            self._granted(p, result)  # into the allowances, even if its request is gone
            if p.answer is not None and not p.answer.done():
                p.answer.set_result(result)
        for a in self._allowances.values():
            a.held_at_call = max(0, a.budget)

    def _read(self, reply: Any, grants: list[Pending]) -> list[Any]:
        """The script's reply, checked against the grants it answers (ValueError when it does not
        fit: a reply not understood must not be read as a grant); learns Redis's clock."""
        if isinstance(reply, bytes):
            reply = reply.decode()
        data = json.loads(reply)
        if isinstance(data, dict) and isinstance(data.get("e"), str):
            self._epoch = data["e"]
        if not isinstance(data, dict) or type(data.get("t")) not in (int, float) or not isinstance(data.get("r"), list):
            raise ValueError(f"unexpected reply {str(reply)[:200]!r}")
        results = data["r"]
        if len(results) != len(grants):
            raise ValueError(f"{len(results)} answers to {len(grants)} grants")
        for p, r in zip(grants, results, strict=True):
            assert p.allowances is not None
            ok = isinstance(r, list) and bool(r) and r[0] in (0, 1, 2)
            if ok and r[0] == 0:
                ok = len(r) == 2 and isinstance(r[1], list) and len(r[1]) == len(p.allowances) and all(
                    isinstance(g, list) and len(g) == 6 and all(type(v) is int for v in g) for g in r[1])
            elif ok and r[0] == 1:
                ok = len(r) == 8 and type(r[1]) is int and 1 <= r[1] <= len(p.allowances) and r[2] in (
                    "concurrent", "requests", "tokens", "budget")
            if not ok:
                raise ValueError(f"unexpected answer {str(r)[:200]!r} to a grant of {len(p.allowances)} scopes")
        self.offset = float(data["t"]) - self._wall()
        return results

    def _lost_epoch(self, reply: Any) -> str | None:
        """The epoch of a Redis that says it lost the data this router's allowances came from, or None."""
        text = reply.decode() if isinstance(reply, bytes) else reply
        if not isinstance(text, str) or not text.startswith('{"lost"'):
            return None
        lost = json.loads(text).get("lost")
        if not isinstance(lost, str):
            raise ValueError(f"unexpected reply {text[:200]!r}")
        self.lost_data += 1
        log.warning("the Redis at %s lost the tenants' limits (restarted without its data, or flushed): this "
                    "router declares what it holds there again", redacted(self.url))
        self._epoch = lost
        return lost

    def _hold_again(self, steps: list[Pending]) -> list[Any]:
        """The "h" step: per allowance, the budget tokens and slots this router holds in Redis (unused,
        reserved by requests in flight, used and not reported yet), with what ``steps`` give back
        of them (those steps run after it, as they would have)."""
        back: dict[tuple[str, str], list[int]] = {}
        for p in steps:
            if p.step[0] == "y":
                for key, part in zip(p.step[1], p.step[2], strict=True):
                    extra = back.setdefault((key, str(part[2])), [0, 0])
                    extra[0] += int(part[5]) + int(part[7])
                    extra[1] += int(part[6])
        keys, parts = [], []
        for a in [*self._allowances.values(), *self._retired]:
            extra = back.get((a.key, a.period), [0, 0])
            budget = max(0, a.budget + a.out + a.used) + extra[0] if a.scope.limits.budget else 0
            slots = max(0, a.slots + a.out_slots) + extra[1] if a.scope.limits.concurrent else 0
            if budget or slots:
                keys.append(a.key)
                parts.append([a.period, budget, slots])
        return ["h", keys, parts]

    def _spent_alone(self) -> dict[str, int]:
        """Scope name -> budget tokens this router took from its allowances since Redis last answered
        (those it dropped since, and those it holds): what it may have spent after Redis went away
        and before it noticed, which neither the ledger nor Redis's last figure counts as used.
        Degraded mode takes them off its share (seen: each router spent its allowance, then a
        whole share: 6,195 of 6,000). Spent before Redis went away, they are counted twice: a
        share smaller by at most that allowance, never larger."""
        out = dict(self._taken_alone)
        for a in self._allowances.values():
            if a.spent_since_call:
                out[a.scope.name] = out.get(a.scope.name, 0) + a.spent_since_call
        return out

    def _broken(self, exc: BaseException) -> None:
        kind = type(exc).__name__
        if self._on_error is not None:
            self._on_error(kind)
        now = self._clock()
        if now - self._error_logged.get(kind, -ERROR_LOG_EVERY) >= ERROR_LOG_EVERY:
            self._error_logged[kind] = now
            log.error("the shared limits' call to Redis at %s failed (%s), not for want of Redis: requests that "
                      "needed it are refused (503) rather than admitted on this router's own limits",
                      redacted(self.url), kind, exc_info=exc)

    def _forget_holdings(self) -> None:
        """After a call that failed, what this router holds in Redis is not known: a call that
        timed out here may have run there. It starts again as a new instance, from nothing; what
        the old one held goes back to everyone when its lease runs out. (Its requests in flight
        end into the old allowances, which are not given back: their lease does it.)"""
        self.instance = secrets.token_hex(8)
        for a in self._allowances.values():
            if a.spent_since_call:
                self._taken_alone[a.scope.name] = self._taken_alone.get(a.scope.name, 0) + a.spent_since_call
        self._allowances = {}
        self._current = {}
        self._retired = []

    def _went_down(self, exc: BaseException) -> None:
        self._down_until = self._clock() + RETRY_AFTER
        if not self.degraded:
            self.degraded = True
            log.error("Redis at %s cannot be reached (%s): limits are applied by this router alone until it "
                      "answers again (degraded mode: budgets from its share of what was left)", redacted(self.url),
                      type(exc).__name__)

    async def close(self) -> None:
        """Give back what this router holds (within a second), then disconnect."""
        if self._hello is not None and not self._hello.done():
            self._hello.cancel()
        if self._sync is not None:
            self._sync.cancel()
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        if not self.degraded:
            self._send_sync(everything=True)
        if self._sync is not None:
            self._sync.cancel()
            self._sync = None
        await self.idle(1.0)
        await self._redis.aclose()

    async def idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every step queued to be answered by Redis (or
        failed); whether it is. What a close waits for, and what a test moving the clock waits on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self._calls or self._queue) and loop.time() < deadline:
            if self._queue and not self._calls:
                self._kick()
            await asyncio.wait(set(self._calls), timeout=max(0.0, deadline - loop.time()))
        return not (self._calls or self._queue)


_KINDS: dict[str, Kind] = {"concurrent": "concurrent", "requests": "requests", "tokens": "tokens", "budget": "budget"}


def _refusal(a: Allowance, r: list[str], reserve: int, now: float) -> Refusal:
    """The refusal the Lua script described (which scope, which limit, what is left), worded by
    the rules as the in-memory limiter words its own, with what this router holds of the scope
    counted as the in-memory limiter would count it: what its allowance has left of a bucket is
    left to the tenant, the slots it holds unused are not in flight, and of the budget it holds,
    what its finished requests used is used and the rest not reserved by anyone. (Seen: a refusal
    said 37 tokens remained, and reset in 45 s, when 50 did and 39 s; the differential test.)"""
    kind = _KINDS[r[2]]  # one of them: checked when the reply was read
    s = a.scope

    def left(v: str, held: int, cap: int | None) -> float | None:  # "nil": that bucket was not read
        return None if v == "nil" else min(float(cap or 0), float(v) + held)
    b = s.limits.budget
    if kind == "concurrent":
        inflight = int(r[6]) - max(0, a.slots)
        used = reserved = 0
        others = False
    else:
        inflight = 0
        used = int(r[6]) + a.used
        reserved = int(r[7]) - a.budget - a.used  # a debt (a request used more than it reserved) too
        others = reserved > a.out  # another router holds some of it
    return refused(s, kind, reserve=reserve, wait=float(r[3]), inflight=inflight, used=used,
                   reserved=reserved, resets=next_period(b, now) if b is not None else 0.0, now=now,
                   held=others, requests_left=left(r[4], a.requests, s.limits.requests_per_minute),
                   tokens_left=left(r[5], a.tokens, s.limits.tokens_per_minute))
