"""Tenants' limits shared by several router processes, in Redis (issue 18).

The same rules as :mod:`llmgw.router.limits` (buckets that refill continuously, requests in
flight, a budget per period with reservations settled from real usage), kept in Redis, where
one Lua script makes every check-and-take atomic for all routers. Keys:
``llmgw:limits:<tenant>[/<model>]:{rpm,tpm,inflight,budget:<period start>}``.

**Allowances.** A router does not ask Redis for every request: it takes an allowance of each
limit (at most a twentieth of it, and never more than is left) and admits from it locally, so
one script call serves many requests. Every :data:`SYNC_EVERY` seconds (and at close) it gives
back what it did not use and reports the budget tokens its finished requests used. What this
costs in exactness, and only for limits above 20 (smaller ones are asked for request by request,
exactly as before): another router may be refused for up to SYNC_EVERY while this one holds an
unused allowance. Nothing is ever admitted beyond a limit: an allowance is taken from what is
left, in one atomic step, so a budget is overshot only by a request that uses more than it reserved.

Degraded mode: when Redis does not answer within :data:`TIMEOUT`, the router applies the limits
with its own in-memory :class:`~llmgw.router.limits.Limiter` (each router then allows the whole
limit on its own share of the traffic), says so in ``llmgw_router_limits_degraded`` and in its
log, and tries Redis again after :data:`RETRY_AFTER`. It never lets a tenant through unlimited.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llmgw.router.limits import Limiter, Refusal, Scope, Ticket, next_period, period_start, refusal

log = logging.getLogger(__name__)

TIMEOUT = 0.25       # seconds Redis gets per call before the router goes it alone
RETRY_AFTER = 5.0    # seconds before a degraded router tries Redis again
EXPIRE = 40 * 86400  # seconds a budget's counts outlive their period (a month's budget and then some)
SYNC_EVERY = 0.25    # seconds an unused allowance stays with a router
CHUNK_SHARE = 20     # an allowance is at most 1/CHUNK_SHARE of its limit
# Script calls one router has under way at once: each carries every step queued while the
# other was out, so requests that need Redis at the same time share a round trip.
CALLS_IN_FLIGHT = 1

# ARGV[1]: a JSON list of steps, each one of
#   ["g", keys, now, [per scope: rpm, tpm, concurrent, budget tokens, period,
#                     need and want of requests, of tokens, of budget tokens, of slots]]
#       grant: for each limit at least `need` (else refuse, taking nothing) and at most `want`
#   ["y", keys, now, [per scope: rpm, tpm, period, requests, tokens, budget tokens and slots
#                     given back, budget tokens used]]
#       sync: give back what a router did not use; what its requests used moves from reserved to used
# Returns a JSON list with, per "g" step in order, [0, [[requests, tokens, budget, slots] per
# scope]] granted, or [1, scope index, kind, wait, requests left, tokens left ("nil": not read),
# used, reserved]. (The keys are not declared: one Redis, not a cluster.)
_STEPS = """
local function bucket(key, cap, now)
  local v = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level == nil then return cap end
  if now > at then level = math.min(cap, level + (now - at) * cap / 60) end
  return level
end

local function grant(K, L, now)
  local got = {}
  for i = 1, #K do
    local x, k = L[i], K[i]
    local rpm, tpm, conc, budget, period = x[1], x[2], x[3], x[4], x[5]
    local g = {0, 0, 0, 0, nil, nil, false}
    local r, t = nil, nil
    if conc > 0 and x[12] > 0 then
      local inflight = tonumber(redis.call('GET', k .. ':inflight') or '0')
      if conc - inflight < x[12] then
        return {1, i, 'concurrent', '1', 'nil', 'nil', tostring(inflight), '0'}
      end
      g[4] = math.min(x[13], conc - inflight)
    end
    if rpm > 0 and x[6] > 0 then
      r = bucket(k .. ':rpm', rpm, now)
      if r < x[6] then return {1, i, 'requests', tostring((x[6] - r) * 60 / rpm), tostring(r), 'nil', '0', '0'} end
      g[1] = math.max(x[6], math.min(x[7], math.floor(r)))
      g[5] = r
    end
    if tpm > 0 and x[8] > 0 then
      t = bucket(k .. ':tpm', tpm, now)
      if t < x[8] then
        return {1, i, 'tokens', tostring((x[8] - t) * 60 / tpm), tostring(r), tostring(t), '0', '0'}
      end
      g[2] = math.max(x[8], math.min(x[9], math.floor(t)))
      g[6] = t
    end
    if budget > 0 and x[10] > 0 then
      local v = redis.call('HMGET', k .. ':budget:' .. period, 'used', 'reserved')
      local used, reserved = tonumber(v[1] or '0'), tonumber(v[2] or '0')
      if budget - used - reserved < x[10] then
        return {1, i, 'budget', '0', tostring(r), tostring(t), tostring(used), tostring(reserved)}
      end
      g[3] = math.min(x[11], budget - used - reserved)
      g[7] = v[1] == false and v[2] == false  -- no such key yet: this step makes it
    end
    got[i] = g
  end
  local out = {}
  for i = 1, #K do
    local x, k, g = L[i], K[i], got[i]
    -- The buckets (one per scope, a few per tenant) need no expiry: a bucket left alone is
    -- full when read again. A period's budget gets its expiry once, when its key is made.
    if g[1] > 0 then redis.call('HSET', k .. ':rpm', 'level', g[5] - g[1], 'at', now) end
    if g[2] > 0 then redis.call('HSET', k .. ':tpm', 'level', g[6] - g[2], 'at', now) end
    if g[4] > 0 then
      -- Renewed with every grant: the count of a router that died holding slots heals an hour
      -- after the tenant's last request, rather than never.
      redis.call('INCRBY', k .. ':inflight', g[4])
      redis.call('EXPIRE', k .. ':inflight', 3600)
    end
    if g[3] > 0 then
      redis.call('HINCRBY', k .. ':budget:' .. x[5], 'reserved', g[3])
      if g[7] then redis.call('EXPIRE', k .. ':budget:' .. x[5], %d) end
    end
    out[i] = {g[1], g[2], g[3], g[4]}
  end
  return {0, out}
end

local function give_back(K, L, now)
  for i = 1, #K do
    local x, k = L[i], K[i]
    local rpm, tpm, period = x[1], x[2], x[3]
    if rpm > 0 and x[4] ~= 0 then
      redis.call('HSET', k .. ':rpm', 'level', math.min(rpm, bucket(k .. ':rpm', rpm, now) + x[4]), 'at', now)
    end
    if tpm > 0 and x[5] ~= 0 then
      redis.call('HSET', k .. ':tpm', 'level', math.min(tpm, bucket(k .. ':tpm', tpm, now) + x[5]), 'at', now)
    end
    if x[6] + x[8] ~= 0 then
      -- Never below 0: a Redis that lost its data (restarted without persistence) must not
      -- hand out what routers give back of an allowance it no longer knows.
      if redis.call('HINCRBY', k .. ':budget:' .. period, 'reserved', -(x[6] + x[8])) < 0 then
        redis.call('HSET', k .. ':budget:' .. period, 'reserved', 0)
      end
    end
    if x[8] ~= 0 then redis.call('HINCRBY', k .. ':budget:' .. period, 'used', x[8]) end
    if x[7] ~= 0 then
      local left = redis.call('DECRBY', k .. ':inflight', x[7])
      if left < 0 then redis.call('SET', k .. ':inflight', 0) end
    end
  end
end

local out = {}
for _, step in ipairs(cjson.decode(ARGV[1])) do
  if step[1] == 'g' then
    out[#out + 1] = grant(step[2], step[4], step[3])
  else
    give_back(step[2], step[4], step[3])
  end
end
if #out == 0 then return '[]' end  -- cjson writes an empty table as {}
return cjson.encode(out)
""" % EXPIRE

# A step queued for the next call, and (a grant) who waits for its answer.
Step = tuple[list[Any], "asyncio.Future[Any] | None"]


def redacted(url: str) -> str:
    """``url`` without its password, for logs and metrics."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def chunk(limit: int | None) -> int:
    return max(1, (limit or 0) // CHUNK_SHARE)


@dataclass
class Allowance:
    """What this router holds of one scope's limits in Redis, to admit from without asking.
    A count may go below zero (a request that used more tokens than it reserved): a debt,
    settled at the next sync."""

    key: str
    scope: Scope
    period: str = "0"
    requests: int = 0
    tokens: int = 0
    budget: int = 0
    slots: int = 0
    used: int = 0  # budget tokens finished requests used, not reported yet (in Redis still as reserved)

    def needs(self, reserve: int) -> tuple[int, int, int, int]:
        """What is missing for one request of ``reserve`` tokens: requests, tokens, budget, slots."""
        lim = self.scope.limits
        return (max(0, 1 - self.requests) if lim.requests_per_minute else 0,
                max(0, min(reserve, lim.tokens_per_minute) - self.tokens) if lim.tokens_per_minute else 0,
                max(0, reserve - self.budget) if lim.budget else 0,
                max(0, 1 - self.slots) if lim.concurrent else 0)

    def take(self, reserve: int) -> None:
        lim = self.scope.limits
        if lim.requests_per_minute:
            self.requests -= 1
        if lim.tokens_per_minute:
            self.tokens -= reserve
        if lim.budget:
            self.budget -= reserve
        if lim.concurrent:
            self.slots -= 1

    def end(self, reserved: int, used: int) -> None:
        """A request admitted from here ended having used ``used`` of its ``reserved`` tokens."""
        lim = self.scope.limits
        if lim.tokens_per_minute:
            self.tokens += reserved - used
        if lim.budget:
            self.budget += reserved - used
            self.used += used
        if lim.concurrent:
            self.slots += 1

    def give_back(self) -> list[Any] | None:
        """This allowance as a sync's part (and emptied), or None when there is nothing to give."""
        lim = self.scope.limits
        part = [lim.requests_per_minute or 0, lim.tokens_per_minute or 0, self.period, self.requests, self.tokens,
                self.budget if lim.budget else 0, self.slots, self.used if lim.budget else 0]
        self.requests = self.tokens = self.budget = self.slots = self.used = 0
        return part if any(part[3:]) else None


class SharedTicket:
    """A request admitted from this router's allowances; its end goes back to them (at most once)."""

    __slots__ = ("_owner", "_allowances", "_reserved", "_used", "_released")

    def __init__(self, owner: SharedLimits, allowances: list[Allowance], reserved: int) -> None:
        self._owner = owner
        self._allowances = allowances
        self._reserved = reserved
        self._used: int | None = None
        self._released = False

    def settle(self, tokens: int) -> None:
        if self._used is None:
            self._used = max(0, tokens)

    def release(self) -> None:
        """The request ended; unsettled, it is taken to have used nothing (it reached no engine)."""
        if self._released:
            return
        self._released = True
        for a in self._allowances:
            a.end(self._reserved, self._used or 0)
        self._owner.schedule_sync()  # what it did not use goes back within SYNC_EVERY


class SharedLimits:
    """The limits of a :class:`Limiter` (its tenants and scopes), counted in Redis at ``url``."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        import redis.asyncio as redis  # only routers configured with Redis load the client

        self.url = url
        self._redis = redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        self._clock = clock
        self._wall = wall
        self._down_until = 0.0
        self.degraded = False
        self._steps = self._redis.register_script(_STEPS)
        self._allowances: dict[tuple[str, str], Allowance] = {}  # (scope name, budget period)
        self._grants: dict[str, asyncio.Future[Any]] = {}  # scope name -> a grant under way
        self._queue: list[Step] = []
        self._calls: set[asyncio.Task[None]] = set()
        self._kick_scheduled = False
        self._sync: asyncio.TimerHandle | None = None
        self._retired: list[Allowance] = []  # of an ended period or old limits, to give back

    async def admit(self, limiter: Limiter, key: str, models: tuple[str, ...], reserve: int,
                    now: float) -> Ticket | SharedTicket | Refusal | None:
        """As :meth:`Limiter.admit`, counted in Redis; in memory while Redis cannot be reached."""
        scopes = limiter.scopes_of(key, models)
        if scopes is None:
            return None
        never = limiter.never_fits(scopes, reserve)
        if never is not None:
            return never
        if self._clock() < self._down_until:
            return limiter.admit(key, models, reserve, now)
        allowances = [self._allowance(s, now) for s in scopes]
        for _ in range(8):
            if not any(any(a.needs(reserve)) for a in allowances):
                break
            # A grant under way for another request may bring enough for this one too; else ask.
            # Checked again after every wait: other requests (or a sync) may have taken it meanwhile.
            waiting = {id(f): f for a in allowances if (f := self._grants.get(a.scope.name)) is not None}
            if waiting:
                await asyncio.wait(list(waiting.values()))
                continue
            refused = await self._grant(allowances, reserve, now)
            if isinstance(refused, Refusal):
                return refused
            if refused is not None:  # Redis failed: this router limits alone meanwhile
                return limiter.admit(key, models, reserve, now)
        # (Still short after eight rounds, under extreme contention: taken as a debt, which the
        # next sync gives back as such, so Redis's counts stay right.)
        for a in allowances:
            a.take(reserve)
        self.schedule_sync()
        return SharedTicket(self, allowances, reserve)

    def _allowance(self, s: Scope, now: float) -> Allowance:
        period = str(int(period_start(s.limits.budget, now))) if s.limits.budget else "0"
        a = self._allowances.get((s.name, period))
        if a is None or a.scope is not s:
            # A new period (the old one's allowance is given back at the next sync, to its own
            # key) or new limits from a new catalog: start from nothing.
            a = Allowance(f"llmgw:limits:{s.name}", s, period)
            old = self._allowances.get((s.name, period))
            if old is not None:
                self._retired.append(old)
            self._allowances[(s.name, period)] = a
        return a

    async def _grant(self, allowances: list[Allowance], reserve: int, now: float) -> Refusal | Exception | None:
        """Top up ``allowances`` to a chunk each (at least what one request needs), in Redis."""
        parts = []
        for a in allowances:
            lim = a.scope.limits
            need = a.needs(reserve)
            want = (max(need[0], chunk(lim.requests_per_minute) - a.requests) if need[0] else 0,
                    max(need[1], chunk(lim.tokens_per_minute) - a.tokens) if need[1] else 0,
                    max(need[2], chunk(lim.budget.tokens if lim.budget else 0) - a.budget) if need[2] else 0,
                    max(need[3], chunk(lim.concurrent) - a.slots) if need[3] else 0)
            parts.append([lim.requests_per_minute or 0, lim.tokens_per_minute or 0, lim.concurrent or 0,
                          lim.budget.tokens if lim.budget else 0, a.period,
                          need[0], want[0], need[1], want[1], need[2], want[2], need[3], want[3]])
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        for a in allowances:
            self._grants.setdefault(a.scope.name, answer)
        self._enqueue((["g", [a.key for a in allowances], now, parts], answer))
        try:
            result = await asyncio.shield(answer)
        except Exception as exc:  # noqa: BLE001 - any failure of Redis: the limits are kept locally
            self._went_down(exc)
            return exc
        finally:
            for a in allowances:
                if self._grants.get(a.scope.name) is answer:
                    del self._grants[a.scope.name]
        if self.degraded:
            self.degraded = False
            log.warning("limits are shared again through Redis at %s", redacted(self.url))
        if int(result[0]) != 0:
            return _refusal(allowances[int(result[1]) - 1].scope, [str(x) for x in result], reserve, now)
        return None

    def _granted(self, step: list[Any], result: list[Any]) -> None:
        """A grant's answer, added to the allowances it was for (whoever still waits for it)."""
        if int(result[0]) != 0:
            return
        keys, parts = step[1], step[3]
        for key, part, got in zip(keys, parts, result[1], strict=True):
            a = self._allowances.get((key.removeprefix("llmgw:limits:"), part[4]))
            if a is None or a.key != key:
                continue
            a.requests += int(got[0])
            a.tokens += int(got[1])
            a.budget += int(got[2])
            a.slots += int(got[3])
        self.schedule_sync()  # the requests it was for may be gone: it goes back unused

    def schedule_sync(self) -> None:
        if self._sync is None:
            self._sync = asyncio.get_running_loop().call_later(SYNC_EVERY, self._send_sync)

    def _send_sync(self) -> None:
        """Give back every allowance's unused part and report what finished requests used."""
        self._sync = None
        by_key: dict[str, list[Any]] = {}
        for a in [*self._retired, *self._allowances.values()]:
            part = a.give_back()
            if part is not None:
                by_key.setdefault(a.key, []).append(part)
        self._retired = []
        if by_key:
            keys = [k for k, ps in by_key.items() for _ in ps]
            self._enqueue((["y", keys, self._wall(), [p for ps in by_key.values() for p in ps]], None))

    def _enqueue(self, step: Step) -> None:
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

    async def _call(self, steps: list[Step]) -> None:
        """Send ``steps`` as one script call; hand each grant its answer."""
        payload = json.dumps([step for step, _ in steps], separators=(",", ":"))
        try:
            async with asyncio.timeout(TIMEOUT):
                results = json.loads(await self._steps(args=[payload]))
        except Exception as exc:  # noqa: BLE001 - any failure of Redis: the waiting requests go local
            self._went_down(exc)
            for _, answer in steps:
                if answer is not None and not answer.done():
                    answer.set_exception(exc)
            return
        grants = ((step, answer) for step, answer in steps if answer is not None)
        for (step, answer), result in zip(grants, results, strict=True):
            self._granted(step, result)  # into the allowances, even if its request is gone
            if not answer.done():
                answer.set_result(result)

    def _went_down(self, exc: BaseException) -> None:
        self._down_until = self._clock() + RETRY_AFTER
        if not self.degraded:
            self.degraded = True
            log.error("Redis at %s cannot be reached (%s): limits are applied by this router alone until it "
                      "answers again (degraded mode)", redacted(self.url), type(exc).__name__)

    async def close(self) -> None:
        """Give back what this router holds (within a second), then disconnect."""
        if self._sync is not None:
            self._sync.cancel()
        if not self.degraded:
            self._send_sync()
        if self._sync is not None:
            self._sync.cancel()
            self._sync = None
        deadline = asyncio.get_running_loop().time() + 1.0
        while (self._calls or self._queue) and asyncio.get_running_loop().time() < deadline:
            if self._queue and not self._calls:
                self._kick()
            await asyncio.wait(set(self._calls), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        await self._redis.aclose()


def _refusal(s: Scope, r: list[str], reserve: int, now: float) -> Refusal:
    """The refusal the Lua script described: which scope, which limit, what is left."""
    kind, wait = r[2], float(r[3])
    lim = s.limits
    if kind == "concurrent":
        why = f"{r[6]} requests of tenant `{s.name}` are in flight, its limit (concurrent: {lim.concurrent})"
    elif kind == "requests":
        why = f"tenant `{s.name}` reached its limit of {lim.requests_per_minute} requests per minute"
    elif kind == "tokens":
        why = f"tenant `{s.name}` reached its limit of {lim.tokens_per_minute} tokens per minute " \
              f"(this request reserves {reserve})"
    else:
        assert lim.budget is not None
        resets = next_period(lim.budget, now)
        wait = resets - now
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(resets))
        why = (f"tenant `{s.name}` has used {r[6]} of its {lim.budget.tokens}-token budget per {lim.budget.per} "
               f"(this request reserves {reserve}; {r[7]} are reserved by requests in flight or held by routers); "
               f"it resets at {when}")
    def left(v: str) -> float | None:  # "nil": that bucket was not read (the script stopped before it)
        return None if v == "nil" else float(v)
    return refusal(lim, why, wait, left(r[4]), left(r[5]))
