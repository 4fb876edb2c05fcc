"""The Lua scripts that count the accounts' budget windows (``proxy.accounts.budgets``) in Redis, so a
tenant's (and a key's) ``tokens_per_minute``, ``tokens_per_day`` and ``requests_per_minute`` hold across
the replicas. Same rules as the in-memory ``Budgets`` (read its docstring for the bound and its proof):
a request admitted with a reserve holds it until charged; without room for its reserve, one request per
window may overshoot; requests are counted when admitted.

Keys of one window ``W`` = ``llamagate:{T}:budget:<subject>:<name>:<budget>`` (``{T}``: the tenant, a
Redis Cluster hash tag, so a request's windows live on one node):

- ``W``: a hash, time (ms) -> amount: for a minute window each charge's own millisecond (exact, as the
  in-memory window; one field per charge in the last minute), for the day window one-minute buckets
  counted until a day after their *end* (never forgotten early: the bound holds; a charge may count up
  to a minute too long);
- ``W:holds`` (sorted set, ticket -> expiry) and ``W:held`` (hash, ticket -> reserve): the reserves of
  requests admitted and not charged yet; ``W:over``: the ticket of the window's overshooter. A hold lives
  until the request is charged or for the request's longest life (``timeouts.total_s``), so a replica
  that dies never holds a budget for longer than its requests could have run.

CHECK (KEYS: one per window, limited windows first; ARGV: ticket, reserve (0: none), hold_ms, n_limited,
then per window: limit (0 for a window only counted), span_ms, width_ms, kind ``r`` or ``t``) answers
``{ok, window index (1-based), retry_ms, used, in_flight}`` followed by the rate-limit headers' figures
(``ok`` 1: admitted, holds taken, request windows counted; 0: refused, the refusal with the longest
wait, as ``Budgets.admit`` picks it). The figures are the cluster-wide ones an answer's
``x-ratelimit-*`` headers show (``proxy.accounts.budgets``'s rules): of the token windows and of the
request windows, the one with the least room left, as ``remaining, limit, reset_ms`` each (limit -1:
no such window), counting this request once admitted (its reserve held, its request counted).

CHARGE (KEYS: the token windows; ARGV: ticket, tokens, then per window span_ms, width_ms) frees the
ticket's holds and adds the tokens.
"""

from __future__ import annotations

CHECK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ticket, reserve, hold_ms, n_limited = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local function used_of(key, span, width)
  local flat = redis.call('HGETALL', key)
  local used, buckets, newest = 0, {}, nil
  for j = 1, #flat, 2 do
    local b, amount = tonumber(flat[j]), tonumber(flat[j + 1])
    if b + width + span <= now then
      redis.call('HDEL', key, flat[j])
    else
      used = used + amount
      buckets[#buckets + 1] = {b, amount}
      if newest == nil or b > newest then newest = b end
    end
  end
  return used, buckets, newest
end
local function bucket_of(width)
  if width > 0 then return math.floor(now / width) * width end
  return now
end
local function wait_below(buckets, used, target, span, width)
  if target <= 0 then return nil end
  if used < target then return 0 end
  table.sort(buckets, function(x, y) return x[1] < y[1] end)
  local remaining = used
  for _, e in ipairs(buckets) do
    remaining = remaining - e[2]
    if remaining < target then return e[1] + width + span - now end
  end
  return nil
end
local plan = {}
local refusal = nil
local figures = {}
for i = 1, n_limited do
  local base = 4 + (i - 1) * 4
  local limit, span = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])
  local width, kind = tonumber(ARGV[base + 3]), ARGV[base + 4]
  local key = KEYS[i]
  local used, buckets, newest = used_of(key, span, width)
  local fig = {kind = kind, limit = limit, used = used, held = 0, newest = newest, span = span, width = width}
  figures[i] = fig
  local why = nil
  if kind == 'r' then
    if used >= limit then
      why = {i, wait_below(buckets, used, limit, span, width) or 0, used, 0}
    end
  else
    local holds, held_key, over_key = key .. ':holds', key .. ':held', key .. ':over'
    local gone = redis.call('ZRANGEBYSCORE', holds, '-inf', now)
    for _, g in ipairs(gone) do
      redis.call('ZREM', holds, g)
      redis.call('HDEL', held_key, g)
    end
    local held = 0
    for _, v in ipairs(redis.call('HVALS', held_key)) do held = held + tonumber(v) end
    fig.held = held
    local over = redis.call('GET', over_key)
    if reserve > 0 and used + held + reserve <= limit then
      plan[#plan + 1] = {key, 'hold', fig}
    elseif not over and used + held < limit then
      plan[#plan + 1] = {key, 'over', fig}
    else
      local after = wait_below(buckets, used, limit - held, span, width) or 1000
      if over and after < 1000 then after = 1000 end
      local in_flight = 0
      if used < limit then in_flight = 1 end
      why = {i, after, used, in_flight}
    end
  end
  if why and (refusal == nil or why[2] > refusal[2]) then refusal = why end
end
-- The headers' figures: per kind, the limited window with the least room left (the first on a tie).
local function headers()
  local out = {}
  for _, kind in ipairs({'t', 'r'}) do
    local best = nil
    for i = 1, n_limited do
      local f = figures[i]
      if f.kind == kind then
        local remaining = f.limit - f.used - f.held
        if best == nil or remaining < best[1] then
          local reset = 0
          if f.newest ~= nil then reset = math.max(0, f.newest + f.width + f.span - now) end
          best = {remaining, f.limit, reset}
        end
      end
    end
    best = best or {0, -1, 0}
    out[#out + 1] = best[1]
    out[#out + 1] = best[2]
    out[#out + 1] = best[3]
  end
  return out
end
if refusal then
  local h = headers()
  return {0, refusal[1], refusal[2], refusal[3], refusal[4], h[1], h[2], h[3], h[4], h[5], h[6]}
end
for _, p in ipairs(plan) do
  local key = p[1]
  if p[2] == 'hold' then
    p[3].held = p[3].held + reserve
    redis.call('ZADD', key .. ':holds', now + hold_ms, ticket)
    redis.call('HSET', key .. ':held', ticket, reserve)
    redis.call('PEXPIRE', key .. ':holds', hold_ms)
    redis.call('PEXPIRE', key .. ':held', hold_ms)
  else
    redis.call('SET', key .. ':over', ticket, 'PX', hold_ms)
    -- Its own worst case does not fit (that is why it overshoots): the headers show nothing left.
    p[3].held = p[3].limit - p[3].used
  end
end
for i = 1, #KEYS do
  local base = 4 + (i - 1) * 4
  local span, width, kind = tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), ARGV[base + 4]
  if kind == 'r' then
    local b = bucket_of(width)
    redis.call('HINCRBY', KEYS[i], b, 1)
    redis.call('PEXPIRE', KEYS[i], span + 2 * width)
    local f = figures[i]
    if f then
      f.used = f.used + 1
      if f.newest == nil or b > f.newest then f.newest = b end
    end
  end
end
local h = headers()
return {1, 0, 0, 0, 0, h[1], h[2], h[3], h[4], h[5], h[6]}
"""

CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ticket, tokens = ARGV[1], tonumber(ARGV[2])
for i = 1, #KEYS do
  local key = KEYS[i]
  local span, width = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  redis.call('ZREM', key .. ':holds', ticket)
  redis.call('HDEL', key .. ':held', ticket)
  if redis.call('GET', key .. ':over') == ticket then redis.call('DEL', key .. ':over') end
  if tokens > 0 then
    local b = now
    if width > 0 then b = math.floor(now / width) * width end
    redis.call('HINCRBY', key, b, tokens)
    redis.call('PEXPIRE', key, span + 2 * width)
  end
end
return 1
"""
