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
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llmgw.router.limits import Limiter, Refusal, Scope, Ticket, next_period, period_start, refusal

log = logging.getLogger(__name__)

TIMEOUT = 0.25       # seconds Redis gets per step before the router goes it alone
RETRY_AFTER = 5.0    # seconds before a degraded router tries Redis again
EXPIRE = 40 * 86400  # seconds a counter outlives its last use (a month's budget and then some)

# KEYS: per scope, its base key. ARGV: now, reserve, then per scope rpm, tpm, concurrent,
# budget tokens (0: none), period start. Returns {0} admitted, or {1, scope index, kind, wait,
# requests left, tokens left ("nil": not read), used, reserved}.
_ADMIT = """
local now, reserve = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = #KEYS
local function bucket(key, cap)
  local v = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level == nil then return cap end
  if now > at then level = math.min(cap, level + (now - at) * cap / 60) end
  return level
end
local levels = {}
for i = 1, n do
  local b = 2 + (i - 1) * 5
  local rpm, tpm, conc, budget, period = tonumber(ARGV[b+1]), tonumber(ARGV[b+2]), tonumber(ARGV[b+3]),
    tonumber(ARGV[b+4]), ARGV[b+5]
  local k = KEYS[i]
  local r, t = nil, nil
  if conc > 0 then
    local inflight = tonumber(redis.call('GET', k .. ':inflight') or '0')
    if inflight >= conc then return {1, i, 'concurrent', '1', 'nil', 'nil', tostring(inflight), '0'} end
  end
  if rpm > 0 then
    r = bucket(k .. ':rpm', rpm)
    if r < 1 then return {1, i, 'requests', tostring((1 - r) * 60 / rpm), tostring(r), 'nil', '0', '0'} end
  end
  if tpm > 0 then
    t = bucket(k .. ':tpm', tpm)
    local need = math.min(reserve, tpm)
    if t < need then return {1, i, 'tokens', tostring((need - t) * 60 / tpm), tostring(r), tostring(t), '0', '0'} end
  end
  if budget > 0 then
    local v = redis.call('HMGET', k .. ':budget:' .. period, 'used', 'reserved')
    local used, reserved = tonumber(v[1] or '0'), tonumber(v[2] or '0')
    if used + reserved + reserve > budget then
      return {1, i, 'budget', '0', tostring(r), tostring(t), tostring(used), tostring(reserved)}
    end
  end
  levels[i] = {r, t}
end
for i = 1, n do
  local b = 2 + (i - 1) * 5
  local rpm, tpm, conc, budget, period = tonumber(ARGV[b+1]), tonumber(ARGV[b+2]), tonumber(ARGV[b+3]),
    tonumber(ARGV[b+4]), ARGV[b+5]
  local k = KEYS[i]
  if rpm > 0 then
    redis.call('HSET', k .. ':rpm', 'level', levels[i][1] - 1, 'at', now)
    redis.call('EXPIRE', k .. ':rpm', 3600)
  end
  if tpm > 0 then
    redis.call('HSET', k .. ':tpm', 'level', levels[i][2] - reserve, 'at', now)
    redis.call('EXPIRE', k .. ':tpm', 3600)
  end
  if conc > 0 then
    redis.call('INCR', k .. ':inflight')
    redis.call('EXPIRE', k .. ':inflight', 3600)
  end
  if budget > 0 then
    redis.call('HINCRBY', k .. ':budget:' .. period, 'reserved', reserve)
    redis.call('EXPIRE', k .. ':budget:' .. period, %d)
  end
end
return {0}
""" % EXPIRE

# KEYS: per scope, its base key. ARGV: reserved, tokens used (-1: only release), then per scope
# tpm, concurrent, budget (0/1), period start.
_SETTLE = """
local reserved, used = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, #KEYS do
  local b = 2 + (i - 1) * 4
  local tpm, conc, budget, period = tonumber(ARGV[b+1]), tonumber(ARGV[b+2]), tonumber(ARGV[b+3]), ARGV[b+4]
  local k = KEYS[i]
  if used >= 0 then
    if tpm > 0 then
      local level = tonumber(redis.call('HGET', k .. ':tpm', 'level') or tostring(tpm))
      redis.call('HSET', k .. ':tpm', 'level', math.min(tpm, level + reserved - used))
    end
    if budget > 0 then
      redis.call('HINCRBY', k .. ':budget:' .. period, 'reserved', -reserved)
      redis.call('HINCRBY', k .. ':budget:' .. period, 'used', used)
    end
  elseif conc > 0 then
    local left = redis.call('DECR', k .. ':inflight')
    if left < 0 then redis.call('SET', k .. ':inflight', 0) end
  end
end
return 0
"""


def redacted(url: str) -> str:
    """``url`` without its password, for logs and metrics."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class SharedTicket:
    """A ticket admitted in Redis: settle and release are sent in the background (at most once)."""

    __slots__ = ("_owner", "_keys", "_scopes", "_period", "_reserved", "_settled", "_released")

    def __init__(self, owner: SharedLimits, keys: list[str], scopes: tuple[Scope, ...], periods: list[str],
                 reserved: int) -> None:
        self._owner, self._keys, self._scopes, self._period = owner, keys, scopes, periods
        self._reserved = reserved
        self._settled = self._released = False

    def _args(self, used: int) -> list[Any]:
        args: list[Any] = [self._reserved, used]
        for s, period in zip(self._scopes, self._period, strict=True):
            lim = s.limits
            args += [lim.tokens_per_minute or 0, lim.concurrent or 0, 1 if lim.budget else 0, period]
        return args

    def settle(self, tokens: int) -> None:
        if not self._settled:
            self._settled = True
            self._owner.send(self._keys, self._args(max(0, tokens)))

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.settle(0)
            self._owner.send(self._keys, self._args(-1))


class SharedLimits:
    """The limits of a :class:`Limiter` (its tenants and scopes), counted in Redis at ``url``."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        import redis.asyncio as redis  # only routers configured with Redis load the client

        self.url = url
        self._redis = redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        self._clock = clock
        self._down_until = 0.0
        self.degraded = False
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)
        self._pending: set[asyncio.Task[Any]] = set()

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
        args: list[Any] = [now, reserve]
        for s, period in zip(scopes, periods, strict=True):
            lim = s.limits
            args += [lim.requests_per_minute or 0, lim.tokens_per_minute or 0, lim.concurrent or 0,
                     lim.budget.tokens if lim.budget else 0, period]
        try:
            async with asyncio.timeout(TIMEOUT):
                result = await self._admit(keys=keys, args=args)
        except Exception as exc:  # noqa: BLE001 - any failure of Redis: the limits are kept locally
            self._went_down(exc)
            return limiter.admit(key, models, reserve, now)
        if self.degraded:
            self.degraded = False
            log.warning("limits are shared again through Redis at %s", redacted(self.url))
        if int(result[0]) == 0:
            return SharedTicket(self, keys, scopes, periods, reserve)
        return _refusal(scopes[int(result[1]) - 1], [x.decode() if isinstance(x, bytes) else str(x) for x in result],
                        reserve, now)

    def send(self, keys: list[str], args: list[Any]) -> None:
        """Settle or release in the background; a failure is logged (degraded mode), never raised."""
        async def run() -> None:
            try:
                async with asyncio.timeout(TIMEOUT * 4):
                    await self._settle(keys=keys, args=args)
            except Exception as exc:  # noqa: BLE001
                self._went_down(exc)

        task = asyncio.get_running_loop().create_task(run())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _went_down(self, exc: BaseException) -> None:
        self._down_until = self._clock() + RETRY_AFTER
        if not self.degraded:
            self.degraded = True
            log.error("Redis at %s cannot be reached (%s): limits are applied by this router alone until it "
                      "answers again (degraded mode)", redacted(self.url), type(exc).__name__)

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=1.0)
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
