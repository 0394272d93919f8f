"""Tenants' limits shared by several router processes, in Redis (issue 18).

The same rules as :mod:`llmgw.router.limits` (buckets that refill continuously, requests in
flight, a budget per period with reservations settled from real usage), kept in Redis and
applied by one Lua script per step, so a check and its take are one atomic operation for every
router. Keys: ``llmgw:limits:<tenant>[/<model>]:{rpm,tpm,inflight,budget:<period start>}``.

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
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llmgw.router.limits import Limiter, Refusal, Scope, Ticket, next_period, period_start, refusal

log = logging.getLogger(__name__)

TIMEOUT = 0.25       # seconds Redis gets per step before the router goes it alone
RETRY_AFTER = 5.0    # seconds before a degraded router tries Redis again
# Script calls one router has under way at once: each carries every step queued while the
# others were out, so a busy router needs few, and one alone would make every request wait a
# round trip for the call before its own.
CALLS_IN_FLIGHT = 1
SETTLE_LINGER = 0.02  # seconds a request's end may wait for an admission's call to ride with
EXPIRE = 40 * 86400  # seconds a counter outlives its last use (a month's budget and then some)

# One script call carries every step the router has queued since its last call (group commit:
# at 32 requests in flight, one round trip and one Lua call admit and settle dozens of them, where
# a call per step cost two thirds of the router's requests/s). The steps run in order, each as
# one atomic check-and-take, exactly as if sent one by one. They travel as one JSON argument and
# the answers come back as one JSON string: encoding hundreds of separate arguments cost the
# router more than Redis's work. (The keys are not declared: one Redis, not a cluster.)
#
# ARGV[1]: a JSON list of steps, each
#   ["a", keys, now, reserve, [rpm, tpm, concurrent, budget tokens (0: none), period] per scope]
#   ["s", keys, reserved, tokens used, [tpm, concurrent, budget (0/1), period] per scope]  (ends a request)
# Returns a JSON list with, per "a" step in order, [0] admitted or [1, scope index, kind, wait,
# requests left, tokens left ("nil": not read), used, reserved].
_STEPS = """
local function bucket(key, cap, now)
  local v = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level == nil then return cap end
  if now > at then level = math.min(cap, level + (now - at) * cap / 60) end
  return level
end

local function admit(K, L, now, reserve)
  local levels = {}
  for i = 1, #K do
    local rpm, tpm, conc, budget, period = L[i][1], L[i][2], L[i][3], L[i][4], L[i][5]
    local k = K[i]
    local r, t, fresh = nil, nil, false
    if conc > 0 then
      local inflight = tonumber(redis.call('GET', k .. ':inflight') or '0')
      if inflight >= conc then return {1, i, 'concurrent', '1', 'nil', 'nil', tostring(inflight), '0'} end
    end
    if rpm > 0 then
      r = bucket(k .. ':rpm', rpm, now)
      if r < 1 then return {1, i, 'requests', tostring((1 - r) * 60 / rpm), tostring(r), 'nil', '0', '0'} end
    end
    if tpm > 0 then
      t = bucket(k .. ':tpm', tpm, now)
      local need = math.min(reserve, tpm)
      if t < need then
        return {1, i, 'tokens', tostring((need - t) * 60 / tpm), tostring(r), tostring(t), '0', '0'}
      end
    end
    if budget > 0 then
      local v = redis.call('HMGET', k .. ':budget:' .. period, 'used', 'reserved')
      local used, reserved = tonumber(v[1] or '0'), tonumber(v[2] or '0')
      if used + reserved + reserve > budget then
        return {1, i, 'budget', '0', tostring(r), tostring(t), tostring(used), tostring(reserved)}
      end
      fresh = v[1] == false and v[2] == false  -- no such key yet: this step makes it
    end
    levels[i] = {r, t, fresh}
  end
  for i = 1, #K do
    local rpm, tpm, conc, budget, period = L[i][1], L[i][2], L[i][3], L[i][4], L[i][5]
    local k = K[i]
    -- The buckets (one per scope, a few per tenant) need no expiry: a bucket left alone is
    -- full when read again. A period's budget gets its expiry once, when its key is made.
    if rpm > 0 then redis.call('HSET', k .. ':rpm', 'level', levels[i][1] - 1, 'at', now) end
    if tpm > 0 then redis.call('HSET', k .. ':tpm', 'level', levels[i][2] - reserve, 'at', now) end
    if conc > 0 then
      -- Renewed with every request: the count of a router that died mid-request heals an hour
      -- after the tenant's last request, rather than never.
      redis.call('INCR', k .. ':inflight')
      redis.call('EXPIRE', k .. ':inflight', 3600)
    end
    if budget > 0 then
      redis.call('HINCRBY', k .. ':budget:' .. period, 'reserved', reserve)
      if levels[i][3] then redis.call('EXPIRE', k .. ':budget:' .. period, %d) end
    end
  end
  return {0}
end

local function settle(K, L, reserved, used)
  for i = 1, #K do
    local tpm, conc, budget, period = L[i][1], L[i][2], L[i][3], L[i][4]
    local k = K[i]
    if tpm > 0 then
      local level = tonumber(redis.call('HGET', k .. ':tpm', 'level') or tostring(tpm))
      redis.call('HSET', k .. ':tpm', 'level', math.min(tpm, level + reserved - used))
    end
    if budget > 0 then
      redis.call('HINCRBY', k .. ':budget:' .. period, 'reserved', -reserved)
      redis.call('HINCRBY', k .. ':budget:' .. period, 'used', used)
    end
    if conc > 0 then
      local left = redis.call('DECR', k .. ':inflight')
      if left < 0 then redis.call('SET', k .. ':inflight', 0) end
    end
  end
end

local out = {}
for _, step in ipairs(cjson.decode(ARGV[1])) do
  if step[1] == 'a' then
    out[#out + 1] = admit(step[2], step[5], step[3], step[4])
  else
    settle(step[2], step[5], step[3], step[4])
  end
end
if #out == 0 then return '[]' end  -- cjson writes an empty table as {}
return cjson.encode(out)
""" % EXPIRE

# A step queued for the next call: the step itself (as it goes to Redis), and (an admission) who
# waits and the ticket it is, released at once if the request was cancelled before the answer.
Step = tuple[list[Any], "asyncio.Future[Any] | None", "SharedTicket | None"]


def redacted(url: str) -> str:
    """``url`` without its password, for logs and metrics."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class SharedTicket:
    """A ticket admitted in Redis. Settling only notes the tokens; the release sends them with the
    end of the request as one step (the router releases every ticket it admitted, in a finally)."""

    __slots__ = ("_owner", "_keys", "_scopes", "_period", "_reserved", "_used", "_released")

    def __init__(self, owner: SharedLimits, keys: list[str], scopes: tuple[Scope, ...], periods: list[str],
                 reserved: int) -> None:
        self._owner, self._keys, self._scopes, self._period = owner, keys, scopes, periods
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
        limits = [[s.limits.tokens_per_minute or 0, s.limits.concurrent or 0, 1 if s.limits.budget else 0, period]
                  for s, period in zip(self._scopes, self._period, strict=True)]
        self._owner.send(["s", self._keys, self._reserved, self._used or 0, limits])


class SharedLimits:
    """The limits of a :class:`Limiter` (its tenants and scopes), counted in Redis at ``url``."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        import redis.asyncio as redis  # only routers configured with Redis load the client

        self.url = url
        self._redis = redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        self._clock = clock
        self._down_until = 0.0
        self.degraded = False
        self._steps = self._redis.register_script(_STEPS)
        self._queue: list[Step] = []
        self._calls: set[asyncio.Task[None]] = set()  # script calls under way
        self._kick_scheduled = False
        self._linger: asyncio.TimerHandle | None = None

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
        keys = [f"llmgw:limits:{s.name}" for s in scopes]
        periods = [str(int(period_start(s.limits.budget, now))) if s.limits.budget else "0" for s in scopes]
        limits = [[s.limits.requests_per_minute or 0, s.limits.tokens_per_minute or 0, s.limits.concurrent or 0,
                   s.limits.budget.tokens if s.limits.budget else 0, period] for s, period in zip(scopes, periods,
                                                                                                   strict=True)]
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ticket = SharedTicket(self, keys, scopes, periods, reserve)
        self._enqueue((["a", keys, now, reserve, limits], answer, ticket))
        try:
            result = await answer
        except Exception as exc:  # noqa: BLE001 - any failure of Redis: the limits are kept locally
            self._went_down(exc)
            return limiter.admit(key, models, reserve, now)
        if self.degraded:
            self.degraded = False
            log.warning("limits are shared again through Redis at %s", redacted(self.url))
        if int(result[0]) == 0:
            return ticket
        return _refusal(scopes[int(result[1]) - 1], [str(x) for x in result], reserve, now)

    def send(self, step: list[Any]) -> None:
        """A request's end (its tokens, its release), with the next admission's call or within
        SETTLE_LINGER; a failure is logged (degraded mode), never raised. Held back, it only makes
        the counts err on the safe side for those milliseconds: a reservation not yet given back."""
        self._queue.append((step, None, None))
        if self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(SETTLE_LINGER, self._flush_settles)

    def _flush_settles(self) -> None:
        self._linger = None
        if self._queue and not self._kick_scheduled and len(self._calls) < CALLS_IN_FLIGHT:
            self._kick()
        elif self._queue:  # a call is out: its end sends what is queued
            self._linger = asyncio.get_running_loop().call_later(SETTLE_LINGER, self._flush_settles)

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
        if any(answer is not None for _, answer, _ in self._queue) and not self._kick_scheduled:
            self._kick()  # admissions wait: at once; ends alone wait for the linger

    async def _call(self, steps: list[Step]) -> None:
        """Send ``steps`` as one script call; hand each admission its answer."""
        payload = json.dumps([step for step, _, _ in steps], separators=(",", ":"))
        try:
            async with asyncio.timeout(TIMEOUT):
                results = json.loads(await self._steps(args=[payload]))
        except Exception as exc:  # noqa: BLE001 - any failure of Redis: the waiting admissions go local
            self._went_down(exc)
            for _, answer, _ in steps:
                if answer is not None and not answer.done():
                    answer.set_exception(exc)
            return
        admits = ((answer, ticket) for _, answer, ticket in steps if answer is not None)
        for (answer, ticket), result in zip(admits, results, strict=True):
            if not answer.done():
                answer.set_result(result)
            elif int(result[0]) == 0 and ticket is not None:
                ticket.release()  # admitted for a request that is gone: nothing holds it

    def _went_down(self, exc: BaseException) -> None:
        self._down_until = self._clock() + RETRY_AFTER
        if not self.degraded:
            self.degraded = True
            log.error("Redis at %s cannot be reached (%s): limits are applied by this router alone until it "
                      "answers again (degraded mode)", redacted(self.url), type(exc).__name__)

    async def close(self) -> None:
        deadline = asyncio.get_running_loop().time() + 1.0
        while (self._calls or self._queue) and asyncio.get_running_loop().time() < deadline:
            if self._queue and not self._calls:
                self._kick()
            # The last settles and releases, within a second.
            await asyncio.wait(set(self._calls), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        if self._linger is not None:
            self._linger.cancel()
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
               f"(this request reserves {reserve}, {r[7]} are reserved by requests in flight); it resets at {when}")
    def left(v: str) -> float | None:  # "nil": that bucket was not read (the script stopped before it)
        return None if v == "nil" else float(v)
    return refusal(lim, why, wait, left(r[4]), left(r[5]))
