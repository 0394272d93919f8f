"""Tenants' limits, enforced at admission (issue 18): requests and tokens per minute, requests in
flight, and a token budget per day or month.

Per minute limits are buckets that refill continuously (a limit of 60 per minute is one a second,
with bursts up to 60). Tokens are reserved at admission, the request's ``max_tokens`` (or
:data:`DEFAULT_COMPLETION_TOKENS`) plus an estimate of its prompt, and settled when it ends from
what the engine reported, so requests running at once cannot overshoot a budget by more than one
reservation each, and a request that used less gives the rest back. A request must fit every
scope it falls in: its tenant's limits, and that tenant's limits for the model, if any; a refusal
takes nothing from any scope.

In memory, for one router process. Pure: the clock is passed in; nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

from llmgw.catalog.model import Limits, Tenant
from llmgw.contract import next_period, period_start
from llmgw.jsonbody import RawJSON

DEFAULT_COMPLETION_TOKENS = 256  # reserved when a request sets no max_tokens


def prompt_estimate(body: bytes | int) -> int:
    """Prompt tokens reserved for a body, before the engine counts them: never fewer than a
    tokenizer may find, or requests in flight together overshoot a budget (what is reserved
    beyond the real count is given back when the request settles). ASCII: a token per 2 bytes
    (short words, "a a a", are that; a token-id list, "0,0,0", has at most that many ids; an
    escaped character, 6 or 12 bytes, is at most 4 byte tokens). Raw non-ASCII text: a token a
    byte (byte-fallback tokenizers). Given only a size (a body not read yet), the ASCII figure:
    the least any body of that size is reserved."""
    if type(body) is int:
        return (body + 1) // 2
    assert isinstance(body, bytes)
    return (len(body) + 1) // 2 if body.isascii() else len(body)


MAX_RESERVATION = 2 ** 31  # a "max_tokens" beyond any context is reserved as this much
# Every field an engine reads as the completion limit of a request, and how it reads them: vLLM and
# SGLang take ``max_completion_tokens or max_tokens`` (so a 0 falls through to the other), llama.cpp
# takes ``n_predict``, then ``max_completion_tokens``, then ``max_tokens``, and reads -1 as
# "unlimited"; the completions endpoints of vLLM and SGLang read ``max_tokens`` alone. Which one
# wins differs, so a request reserves the largest of them, and the body is sent with each of them
# set to that (``capped_fields``): a request naming 1 in one field and 50,000 in another reserved 1
# and was served 50,000.
COMPLETION_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict")
# Answers per prompt: OpenAI's and vLLM's ``n``, ``best_of`` (generated, then the best n returned),
# llama.cpp's ``n_cmpl`` (read before its alias ``n``). Each answer may write the whole limit.
ANSWER_FIELDS = ("n", "best_of", "n_cmpl")
# OpenAI's own bound on n. Beyond it a request is refused (400) rather than reserved as if it
# asked for fewer answers than the engine will write.
MAX_ANSWERS = 128


class BadLimitField(ValueError):
    """A completion-limit or answer-count field no engine would read as a count (a 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Asked(NamedTuple):
    """What a request asks engines to generate, read as the most generous engine reads it."""

    completion: int | None  # the largest completion limit set; None: none set, or "unlimited"
    answers: int            # answers per prompt times prompts (each may write ``completion``)
    fields: tuple[str, ...]  # the completion-limit fields present in the body


def asked_for(body: Mapping[str, object]) -> Asked:
    """The request's completion limit and answer count; :class:`BadLimitField` when a field holds
    something that is not a count (engines disagree on what such a value means)."""
    completion: int | None = None
    fields: tuple[str, ...] = ()
    for f in COMPLETION_FIELDS:
        if f not in body:
            continue
        fields += (f,)
        v = body[f]
        if v is None:
            continue  # llama.cpp would look at a null before the next field: rewritten like the rest
        n = v if type(v) is int else _count(v)
        if n is None:
            raise BadLimitField(f, f"`{f}` must be a whole number of tokens, not {_shown(v)}.")
        # 0: vLLM's and SGLang's ``or`` reads it as unset, falling through: not a limit.
        # Negative: llama.cpp's "unlimited" (-1); vLLM and SGLang refuse it. Neither caps anything.
        if n > 0:
            completion = n if completion is None else max(completion, n)
    answers = 1
    for f in ANSWER_FIELDS:
        v = body.get(f)
        if v is None:
            continue
        n = _count(v)
        if n is None or not 1 <= n <= MAX_ANSWERS:
            raise BadLimitField(f, f"`{f}` must be a whole number from 1 to {MAX_ANSWERS}, not {_shown(v)}: "
                                   "each answer is reserved from the tenant's limits.")
        if n > answers:
            answers = n
    prompt = body.get("prompt")
    if prompt is not None:
        answers *= _prompts(prompt)
    return Asked(completion, answers, fields)


def _prompts(prompt: object) -> int:
    """Prompts in a completions request: a list of strings or of token lists is a batch, each
    prompt answered on its own (vLLM, SGLang and llama.cpp alike)."""
    if type(prompt) is RawJSON:  # a big body's prompt, left as text: counted where it was parsed
        return prompt.prompts
    if type(prompt) is list and prompt and type(prompt[0]) in (str, list):
        return len(prompt)
    return 1


def _shown(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def reservation(body: Mapping[str, object], raw: bytes | int) -> int:
    """Tokens a request reserves: its completion limit (the largest of every field an engine
    reads, a number or a numeric string; :data:`DEFAULT_COMPLETION_TOKENS` when none is set),
    times its answers and prompts, plus the prompt estimate. :class:`BadLimitField` as :func:`asked_for`."""
    return reserve_for(asked_for(body), raw)


def reserve_for(a: Asked, raw: bytes | int) -> int:
    """As :func:`reservation`; ``raw``: the body (or its size: see :func:`prompt_estimate`)."""
    completion = DEFAULT_COMPLETION_TOKENS if a.completion is None else a.completion
    return min(MAX_RESERVATION, min(completion, MAX_RESERVATION) * a.answers + prompt_estimate(raw))


# What each endpoint's engines read as the completion limit (see COMPLETION_FIELDS): every one is
# sent, whatever the body named, so no engine finds a field the router did not reserve for.
# ``max_completion_tokens`` is a chat field (vLLM's and SGLang's completions do not read it).
CHAT_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
COMPLETIONS_LIMIT_FIELDS = ("max_tokens", "n_predict")


def capped_fields(a: Asked, *, chat: bool, cap_unasked: bool) -> dict[str, int] | None:
    """The completion-limit fields to send so that no engine writes more than was reserved: every
    field the endpoint's engines read (and any other the body named), each set to the reserved
    limit, whatever the body said (an engine reads whichever it prefers, and a field the router
    did not look at would be a limit nobody reserved: vLLM reads ``max_completion_tokens or
    max_tokens``, llama.cpp ``n_predict`` first). A request that names no field is sent as it
    came unless ``cap_unasked`` (a tenant with a budget: unasked, an engine writes up to its
    context, many reservations past the budget); then None."""
    if a.completion is None and not a.fields and not cap_unasked:
        return None
    limit = DEFAULT_COMPLETION_TOKENS if a.completion is None else a.completion
    names = CHAT_LIMIT_FIELDS if chat else COMPLETIONS_LIMIT_FIELDS
    return {f: limit for f in (*names, *(f for f in a.fields if f not in names))}


def completion_asked(body: Mapping[str, object]) -> int | None:
    """The largest completion limit a request sets; None when absent or "unlimited" (llama.cpp's -1)."""
    return asked_for(body).completion


def _count(v: object) -> int | None:
    if type(v) is bool:
        return None
    if type(v) is int:
        return v
    if type(v) is float and math.isfinite(v):
        return int(v)
    if type(v) is str:
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


@dataclass(slots=True)
class Bucket:
    """``capacity`` units, refilled at ``capacity`` per minute."""

    capacity: float
    level: float = math.nan
    at: float = 0.0

    def refill(self, now: float) -> float:
        if math.isnan(self.level):
            self.level, self.at = self.capacity, now
        elif now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / 60.0)
            self.at = now
        return self.level

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` is available (after refill)."""
        return 0.0 if self.level >= amount else (amount - self.level) * 60.0 / self.capacity

    def until_full(self) -> float:
        return (self.capacity - self.level) * 60.0 / self.capacity


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


class Ticket:
    """An admitted request: settle its real tokens, then release it (both at most once)."""

    __slots__ = ("_scopes", "_reserved", "_settled", "_released", "_floor")

    def __init__(self, scopes: tuple[Scope, ...], reserved: int) -> None:
        self._scopes = scopes
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
        for s in self._scopes:
            s.reserved -= self._reserved
            s.used += tokens
            if s.tokens is not None:
                # The bucket was charged the reservation: give back what was not used, or take the
                # excess (it may go below zero: the next requests wait for it).
                s.tokens.level = min(s.tokens.capacity, s.tokens.level + self._reserved - tokens)

    def release(self) -> None:
        """The request ended; unsettled, it is charged :meth:`charge_at_least`'s figure (0: it
        reached no engine)."""
        if self._released:
            return
        self._released = True
        self.settle(self._floor)
        for s in self._scopes:
            s.inflight -= 1


_UNKNOWN = object()


class Limiter:
    """Every tenant's scopes, by key name."""

    def __init__(self, tenants: Iterable[Tenant] = ()) -> None:
        self._tenant_of: dict[str, str] = {}
        self._scopes: dict[tuple[str, str], Scope] = {}
        # The ledger's figures, by (tenant, model or ""), and the routers the controller knows of.
        self._ledger: dict[tuple[str, str], tuple[float, int]] = {}
        self.routers = 1
        self.degraded = False  # budgets granted from this router's share (see degrade())
        # Asked on every request with a key: found once per key and model chain.
        self._scopes_of: dict[tuple[str, tuple[str, ...]], tuple[Scope, ...] | None] = {}
        for t in tenants:
            for k in t.keys:
                self._tenant_of.setdefault(k, t.name)
            self._scopes[(t.name, "")] = Scope(t.name, t.limits)
            for model, limits in t.models:
                self._scopes[(t.name, model)] = Scope(f"{t.name}/{model}", limits)

    def tenant(self, key: str) -> str | None:
        return self._tenant_of.get(key)

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
        self.set_spent(old._ledger, routers=old.routers)

    def set_spent(self, figures: Mapping[tuple[str, str], tuple[float, int]], *, routers: int) -> None:
        """The ledger's figures (tenant, model or "" → period start, tokens used) and how many
        routers share the limits, as the controller last said."""
        self._ledger = dict(figures)
        self.routers = max(1, routers)
        for k, s in self._scopes.items():
            s.ledger = self._ledger.get(k, (0.0, 0))

    def scopes(self) -> Iterable[Scope]:
        return self._scopes.values()

    def degrade(self, known: Mapping[str, tuple[float, int]], now: float) -> None:
        """Redis went away: from now on each budget is granted from this router's share of what
        was left (its remaining tokens per the ledger, or ``known`` — scope name → period, tokens
        Redis last said were used and reserved — whichever says more was spent, divided among the
        routers), never from a fresh budget: N routers alone must not grant N budgets. Scopes
        already degraded (carried over from the last catalog) keep their share."""
        self.degraded = True
        for s in self._scopes.values():
            b = s.limits.budget
            if b is None or s.share is not None:
                continue
            start = period_start(b, now)
            seen = known.get(s.name)
            base = max(s.ledger_used(start), seen[1] if seen is not None and seen[0] == start else 0)
            s.period, s.used, s.base = start, 0, base
            s.share = max(0, b.tokens - base) // self.routers

    def undegrade(self) -> None:
        """Redis answers again: budgets are counted there (the in-memory counts wait for the next time)."""
        self.degraded = False
        for s in self._scopes.values():
            s.share = None

    def admit(self, key: str, models: tuple[str, ...], reserve: int, now: float) -> Ticket | Refusal | None:
        """A ticket, a refusal, or None when the key is in no tenant (not limited). ``models``: the
        model asked for and its fallbacks; any may serve, so the request must fit each one's limits."""
        scopes = self.scopes_of(key, models)
        if scopes is None:
            return None
        for s in scopes:
            refused = self._check(s, reserve, now)
            if refused is not None:
                return refused
        for s in scopes:
            if s.requests is not None:
                s.requests.level -= 1
            if s.tokens is not None:
                s.tokens.level -= reserve  # may go below zero: the next requests wait for it
            s.inflight += 1
            s.reserved += reserve
        return Ticket(scopes, reserve)

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
        return self.never_fits((s,), reserve) or self._check(s, reserve, now)

    @staticmethod
    def never_fits(scopes: tuple[Scope, ...], reserve: int) -> Refusal | None:
        """A refusal when ``reserve`` alone exceeds a scope's whole budget: waiting cannot help."""
        for s in scopes:
            b = s.limits.budget
            if b is not None and reserve > b.tokens:
                return Refusal(f"This request reserves {reserve} tokens (the largest of its max_tokens, "
                               "max_completion_tokens and n_predict, times its answers, plus its prompt), more than "
                               f"tenant `{s.name}`'s whole budget of {b.tokens} per {b.per}: lower max_tokens.", 0.0,
                               fits_never=True)
        return None

    def _check(self, s: Scope, reserve: int, now: float) -> Refusal | None:
        lim = s.limits
        if lim.concurrent is not None and s.inflight >= lim.concurrent:
            return self._refuse(s, f"{s.inflight} requests of tenant `{s.name}` are in flight, its limit "
                                   f"(concurrent: {lim.concurrent})", 1.0)
        if s.requests is not None:
            s.requests.refill(now)
            if s.requests.level < 1:
                return self._refuse(s, f"tenant `{s.name}` reached its limit of {lim.requests_per_minute} "
                                       "requests per minute", s.requests.wait(1))
        if s.tokens is not None:
            s.tokens.refill(now)
            need = min(reserve, s.tokens.capacity)
            if s.tokens.level < need:
                return self._refuse(s, f"tenant `{s.name}` reached its limit of {lim.tokens_per_minute} tokens "
                                       f"per minute (this request reserves {reserve})", s.tokens.wait(need))
        if lim.budget is not None:
            if reserve > lim.budget.tokens:
                return self.never_fits((s,), reserve)
            start = period_start(lim.budget, now)
            if start != s.period:
                s.period, s.used = start, 0  # a new period: what was used before no longer counts
                if s.share is not None:  # degraded across the reset: a share of the new period
                    s.base = s.ledger_used(start)
                    s.share = max(0, lim.budget.tokens - s.base) // self.routers
            spent = s.spent()
            if spent + s.reserved + reserve > (lim.budget.tokens if s.share is None else s.share):
                resets = next_period(lim.budget, now)
                when = datetime.fromtimestamp(resets, UTC).strftime("%Y-%m-%d %H:%M UTC")
                used = spent if s.share is None else s.base + spent
                alone = "" if s.share is None else (
                    f"; while the routers cannot share limits (Redis away) this router may grant {s.share} of "
                    f"the {max(0, lim.budget.tokens - s.base)} left, its share of {self.routers} routers")
                return self._refuse(s, f"tenant `{s.name}` has used {used} of its {lim.budget.tokens}-token budget "
                                       f"per {lim.budget.per} (this request reserves {reserve}, {s.reserved} are "
                                       f"reserved by requests in flight{alone}); it resets at {when}", resets - now)
        return None

    def _refuse(self, s: Scope, why: str, retry_after: float) -> Refusal:
        return refusal(s.limits, why, retry_after, None if s.requests is None else s.requests.level,
                       None if s.tokens is None else s.tokens.level)


def refusal(limits: Limits, why: str, retry_after: float, requests_left: float | None,
            tokens_left: float | None) -> Refusal:
    """The 429's message and OpenAI's headers, from what is left in each bucket (None: unknown, full)."""
    headers: dict[str, str] = {}
    for kind, cap, left in (("requests", limits.requests_per_minute, requests_left),
                            ("tokens", limits.tokens_per_minute, tokens_left)):
        if cap:
            level = float(cap) if left is None else left
            headers[f"x-ratelimit-limit-{kind}"] = str(cap)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
            headers[f"x-ratelimit-reset-{kind}"] = duration(max(0.0, (cap - level) * 60.0 / cap))
    return Refusal(f"Rate limit reached: {why}. Retry in {duration(retry_after)}.", max(0.0, retry_after), headers)


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: 20ms, 1s, 6m0s, 2h3m4s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"
