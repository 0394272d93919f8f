"""The Lua script that applies the tenants' rules (:mod:`llmgw.tenancy.rules`) to counts kept in
Redis, atomically for every router, and the arguments it takes, built from those rules' figures
(:func:`grant_part`, :func:`give_back_part`). :mod:`llmgw.tenancy.shared` moves state: it decides
what to ask for and what to give back, queues the steps and reads the answers.
"""

from __future__ import annotations

from typing import Any

from llmgw.catalog.model import Limits
from llmgw.tenancy.rules import Counts

EXPIRE = 40 * 86400  # seconds a budget's counts outlive their period (a month's budget and then some)


def grant_part(limits: Limits, *, period: str, need: Counts, want: Counts | list[int], floor: int,
               period_end: float, owe: int = 0) -> list[Any]:
    """One scope's part of a grant step: for each limit at least ``need`` (else the whole step is
    refused, taking nothing) and at most ``want``; ``floor``: what the controller's ledger says
    the budget used this period; ``period``, ``period_end``: the budget period, as this router named it;
    ``owe``: tokens the tokens bucket goes into debt by beyond what is granted (a request bigger
    than the bucket takes it whole and the rest, as in :func:`llmgw.tenancy.rules.take`)."""
    return [limits.requests_per_minute or 0, limits.tokens_per_minute or 0, limits.concurrent or 0,
            limits.budget.tokens if limits.budget else 0, period,
            need[0], want[0], need[1], want[1], need[2], want[2], need[3], want[3], floor, period_end, owe]


def give_back_part(limits: Limits, *, period: str, given: Counts, used: int) -> list[Any]:
    """One scope's part of a sync step: what this router gives back of each count, and the budget
    tokens its finished requests used (moved from reserved to used)."""
    return [limits.requests_per_minute or 0, limits.tokens_per_minute or 0, period, *given, used]


# ARGV[1]: a JSON list of steps, each one of
#   ["g", keys, [per scope: rpm, tpm, concurrent, budget tokens, period, need and want of requests,
#                of tokens, of budget tokens, of slots, ledger floor, period end, tokens owed beyond]]
#       grant: for each limit at least `need` (else refuse, taking nothing) and at most `want`
#   ["y", keys, [per scope: rpm, tpm, period, requests, tokens, budget tokens and slots given back,
#                budget tokens used]]
#       sync: give back what a router did not use; what its requests used moves from reserved to used
#   ["h", keys, [per scope: budget period, budget tokens held, slots held]]
#       hold again: what a router holds, declared to a Redis that lost its data (see the epoch below)
# ARGV[2]: the calling router's instance; ARGV[3]: its lease, in seconds; ARGV[4]: the data's epoch as
# the router last saw it ("" when it holds nothing); ARGV[5], optional: the time to run by instead of the
# server's (a test driving the memory and Redis limiters by one clock; routers never send it).
# Returns {"lost": the epoch} (nothing done) when ARGV[4] is not this Redis's epoch, else
# {"t": the Redis server's time, "e": the epoch, "r": [per "g" step in order: [0, [[requests, tokens,
# budget, slots, budget used, budget reserved (-1: not read)] per scope]] granted, or [1, scope
# index, kind, wait, requests left, tokens left ("nil": not read), used, reserved] refused, or [2]
# when the router's budget period is not the one the server's clock is in]}. (The keys are not
# declared: one Redis, not a cluster.)
#
# One clock: buckets refill, periods are checked and leases run by the Redis server's TIME, never
# by a router's own clock (a router 60 s behind let a 5-a-minute limit admit 30 in 9 s, each
# router's refill undoing the other's). Scripts that call TIME before writing need effects
# replication, the default since Redis 5.
#
# Budgets start from the ledger: a grant carries what the controller's ledger says the scope used
# this period (``floor``), and a budget's ``used`` is never below it, so a Redis restarted without
# its data (or a new one) does not hand every tenant a fresh budget.
#
# The epoch names this Redis's data: set by the first call that finds none (a new Redis, or one that
# restarted without its data, or was flushed). A router holding allowances of another epoch
# holds what this Redis never granted: it is told so before anything is done, and calls again
# declaring what it holds ("h", first) with the same steps, so this Redis counts it as reserved
# rather than grant it again (seen: routers went on admitting from a lost Redis's allowances,
# 21,267 of 20,000 tokens).
#
# What a router holds (budget tokens reserved, slots in flight) is also written down under its
# instance, with a lease renewed by each of its calls: the first call after a lease ran out
# (a router killed, or cut off) gives what that router held back to everyone, so a crash does
# not keep a twentieth of a budget reserved until the period ends.
STEPS = """
local inst, lease = ARGV[2], tonumber(ARGV[3])
local held = 'llmgw:limits:held:' .. inst
local LEASES = 'llmgw:limits:leases'

local clock = tonumber(ARGV[5] or '')
if clock == nil then
  clock = redis.call('TIME')
  clock = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
end

local epoch = redis.call('GET', 'llmgw:limits:epoch')
if not epoch then
  epoch = inst .. '@' .. string.format('%%.6f', clock)
  redis.call('SET', 'llmgw:limits:epoch', epoch)
end
if ARGV[4] ~= '' and ARGV[4] ~= epoch then return cjson.encode({lost = epoch}) end

-- A number written whole: Redis writes a Lua number with 14 digits, which cut a clock of 10 digits
-- to a tenth of a millisecond and set levels apart from the in-memory ones (the differential test).
local function exact(x) return string.format('%%.17g', x) end

local function bucket(key, cap)
  local v = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level == nil then return cap end
  if clock > at then level = math.min(cap, level + (clock - at) * cap / 60) end
  return level
end

-- n more of a count (a budget's reserved tokens, or a scope's slots in flight), at f.
local function count(f, n)
  if string.sub(f, -9) == ':inflight' then
    if redis.call('INCRBY', f, n) < 0 then redis.call('SET', f, 0) end
  else
    local r = redis.call('HINCRBY', f, 'reserved', n)
    -- Never below 0: a Redis that lost its data (restarted without persistence) must not
    -- hand out what routers give back of an allowance it no longer knows.
    if r < 0 then redis.call('HSET', f, 'reserved', 0) end
    -- A period's budget expires once it cannot be asked for again.
    if n > 0 and r == n then redis.call('EXPIRE', f, %d) end
  end
end

-- This router takes n (n > 0) or gives back -n: never more than it holds, so a router whose
-- holdings were already given back for it (its lease ran out) takes nothing from the others.
local function hold(f, n)
  if n < 0 then
    n = -math.min(-n, tonumber(redis.call('HGET', held, f) or '0'))
    if n == 0 then return end
  end
  if redis.call('HINCRBY', held, f, n) <= 0 then redis.call('HDEL', held, f) end
  count(f, n)
end

for _, other in ipairs(redis.call('ZRANGEBYSCORE', LEASES, '-inf', clock, 'LIMIT', 0, 16)) do
  if other ~= inst then
    local h = 'llmgw:limits:held:' .. other
    local kv = redis.call('HGETALL', h)
    for j = 1, #kv, 2 do
      if redis.call('EXISTS', kv[j]) == 1 then count(kv[j], -tonumber(kv[j + 1])) end
    end
    redis.call('DEL', h)
  end
  redis.call('ZREM', LEASES, other)
end
redis.call('ZADD', LEASES, clock + lease, inst)

local function grant(K, L)
  local got = {}
  for i = 1, #K do
    local x, k = L[i], K[i]
    local rpm, tpm, conc, budget, period = x[1], x[2], x[3], x[4], x[5]
    local g = {0, 0, 0, 0, nil, nil, -1, -1}
    local r, t = nil, nil
    if conc > 0 and x[12] > 0 then
      local inflight = tonumber(redis.call('GET', k .. ':inflight') or '0')
      if conc - inflight < x[12] then
        -- What the buckets have, for the refusal's headers (read, not taken).
        return {1, i, 'concurrent', '1', rpm > 0 and tostring(bucket(k .. ':rpm', rpm)) or 'nil',
                tpm > 0 and tostring(bucket(k .. ':tpm', tpm)) or 'nil', tostring(inflight), '0'}
      end
      g[4] = math.min(x[13], conc - inflight)
    end
    if rpm > 0 and x[6] > 0 then
      r = bucket(k .. ':rpm', rpm)
      if r < x[6] then return {1, i, 'requests', tostring((x[6] - r) * 60 / rpm), tostring(r), 'nil', '0', '0'} end
      g[1] = math.max(x[6], math.min(x[7], math.floor(r)))
      g[5] = r
    end
    if tpm > 0 and x[8] > 0 then
      t = bucket(k .. ':tpm', tpm)
      if t < x[8] then
        return {1, i, 'tokens', tostring((x[8] - t) * 60 / tpm), tostring(r), tostring(t), '0', '0'}
      end
      g[2] = math.max(x[8], math.min(x[9], math.floor(t)))
      g[6] = t
    end
    if budget > 0 and x[10] > 0 then
      -- The router named its period from its own clock: the server's decides which it is.
      if clock < tonumber(period) or clock >= x[15] then return {2} end
      local f = k .. ':budget:' .. period
      local v = redis.call('HMGET', f, 'used', 'reserved')
      local used, reserved = tonumber(v[1] or '0'), tonumber(v[2] or '0')
      if x[14] > used then  -- the ledger knows of more: a Redis that lost its data, or a new one
        local new = redis.call('EXISTS', f) == 0
        redis.call('HSET', f, 'used', x[14])
        if new then redis.call('EXPIRE', f, %d) end
        used = x[14]
      end
      if budget - used - reserved < x[10] then
        return {1, i, 'budget', '0', tostring(r), tostring(t), tostring(used), tostring(reserved)}
      end
      g[3] = math.min(x[11], budget - used - reserved)
      g[7], g[8] = used, reserved + g[3]
    end
    got[i] = g
  end
  local out = {}
  for i = 1, #K do
    local x, k, g = L[i], K[i], got[i]
    -- The buckets (one per scope, a few per tenant) need no expiry: a bucket left alone is
    -- full when read again.
    if g[1] > 0 then redis.call('HSET', k .. ':rpm', 'level', exact(g[5] - g[1]), 'at', exact(clock)) end
    if g[2] > 0 then redis.call('HSET', k .. ':tpm', 'level', exact(g[6] - g[2] - (x[16] or 0)), 'at', exact(clock)) end
    if g[4] > 0 then hold(k .. ':inflight', g[4]) end
    if g[3] > 0 then hold(k .. ':budget:' .. x[5], g[3]) end
    out[i] = {g[1], g[2], g[3], g[4], g[7], g[8]}
  end
  return {0, out}
end

local function give_back(K, L)
  for i = 1, #K do
    local x, k = L[i], K[i]
    local rpm, tpm, period = x[1], x[2], x[3]
    if rpm > 0 and x[4] ~= 0 then
      local level = math.min(rpm, bucket(k .. ':rpm', rpm) + x[4])
      redis.call('HSET', k .. ':rpm', 'level', exact(level), 'at', exact(clock))
    end
    if tpm > 0 and x[5] ~= 0 then
      local level = math.min(tpm, bucket(k .. ':tpm', tpm) + x[5])
      redis.call('HSET', k .. ':tpm', 'level', exact(level), 'at', exact(clock))
    end
    -- A negative part is a debt (taken beyond the allowance when grants fell behind): held more.
    if x[6] + x[8] ~= 0 then hold(k .. ':budget:' .. period, -(x[6] + x[8])) end
    if x[8] ~= 0 then redis.call('HINCRBY', k .. ':budget:' .. period, 'used', x[8]) end
    if x[7] ~= 0 then hold(k .. ':inflight', -x[7]) end
  end
end

local function hold_again(K, L)
  for i = 1, #K do
    local x, k = L[i], K[i]
    if x[2] > 0 then hold(k .. ':budget:' .. x[1], x[2]) end
    if x[3] > 0 then hold(k .. ':inflight', x[3]) end
  end
end

local out = {}
for _, step in ipairs(cjson.decode(ARGV[1])) do
  if step[1] == 'g' then
    out[#out + 1] = grant(step[2], step[3])
  elseif step[1] == 'h' then
    hold_again(step[2], step[3])
  else
    give_back(step[2], step[3])
  end
end
-- cjson writes an empty table as {}; the time as a number with its microseconds.
return '{"t":' .. string.format('%%.6f', clock) .. ',"e":' .. cjson.encode(epoch) .. ',"r":'
  .. (#out == 0 and '[]' or cjson.encode(out)) .. '}'
""" % (EXPIRE, EXPIRE)
