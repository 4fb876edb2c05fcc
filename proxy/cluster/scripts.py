"""The Lua scripts that hold a tenant's concurrency as leases in Redis. Each runs atomically in Redis, so
replicas never race between counting and adding; time is Redis's own (``TIME``), so the replicas' clocks
never matter.

Keys of one lease group (a model and a tenant; ``{tenant}`` is a Redis Cluster hash tag, so a tenant's keys
live on one node and a script may touch them all):

- ``llamagate:{T}:lease:M``: the leases, a sorted set of members ``<request id>#<k>`` (one per slot the
  request occupies) scored by their expiry in milliseconds. A lease not renewed by its expiry is dropped
  by the next script that looks: that is how a dead replica's leases free themselves, within the TTL;
- ``llamagate:{T}:lease:*``: the tenant's total across models (``max_concurrency_total``), same shape;
- ``llamagate:{T}:queue:M``: the waiters, in the order of their *virtual arrival* (score: when each
  first asked, less its priority's head start: ``proxy.admission.gate``'s order, so priorities and aging
  hold across replicas as they do in one gate), and ``llamagate:{T}:alive:M``: each waiter's own expiry,
  pushed on at every retry, so a waiter whose replica died leaves the line by expiry too.

ACQUIRE (KEYS: queue, alive, lease group..., ARGV: member, ttl_ms, slots, max_queue, head_start_ms, join,
limit per lease group) drops expired leases and waiters, and grants when the slots fit every group's
limit after the waiters ahead of this one (those whose virtual arrival comes first, whatever replica
they wait on); otherwise it puts the caller in line (``join`` 0: it does not wait, so it stays out; a
full line: refused) and says how long until the soonest lease expires. Answer: ``{1, 0}`` granted,
``{0, ms}`` wait, ``{-1, 0}`` the line is full.

RENEW (KEYS: a lease group per lease, ARGV: ttl_ms, then each lease's member and slots) pushes every lease
this replica holds to ``now + ttl`` in one call. It adds a lease that is missing (Redis restarted empty,
or its expiry passed while Redis was unreachable): the request holding it still runs, so counting it is
the truth even when that is over the limit for a while.

RELEASE (KEYS: queue, alive, lease group..., ARGV: member, slots) removes a request's leases, or its place
in line when it gave up waiting.
"""

from __future__ import annotations

ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, ttl, slots, max_queue = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local head_start, join = tonumber(ARGV[5]), tonumber(ARGV[6])
local arrival = now - head_start
local queue, alive = KEYS[1], KEYS[2]
local gone = redis.call('ZRANGEBYSCORE', alive, '-inf', now)
for _, w in ipairs(gone) do
  redis.call('ZREM', alive, w)
  redis.call('ZREM', queue, w)
end
local room = nil
local soonest = nil
for i = 3, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  local free = tonumber(ARGV[i + 4]) - redis.call('ZCARD', KEYS[i])
  if room == nil or free < room then room = free end
  local first = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
  if first[2] ~= nil then
    local at = tonumber(first[2]) - now
    if soonest == nil or at < soonest then soonest = at end
  end
end
local rank = redis.call('ZRANK', queue, me)
local ahead = rank or redis.call('ZCOUNT', queue, '-inf', arrival)
if ahead + slots <= room then
  for i = 3, #KEYS do
    for k = 1, slots do
      redis.call('ZADD', KEYS[i], now + ttl, me .. '#' .. k)
    end
    redis.call('PEXPIRE', KEYS[i], 2 * ttl)
  end
  if rank then
    redis.call('ZREM', queue, me)
    redis.call('ZREM', alive, me)
  end
  return {1, 0}
end
if not rank then
  if redis.call('ZCARD', queue) >= max_queue then
    return {-1, 0}
  end
  if join == 0 then
    return {0, soonest or ttl}
  end
  redis.call('ZADD', queue, arrival, me)
end
redis.call('ZADD', alive, now + ttl, me)
redis.call('PEXPIRE', queue, 2 * ttl)
redis.call('PEXPIRE', alive, 2 * ttl)
return {0, soonest or ttl}
"""

RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local n = 0
for i = 1, #KEYS do
  local me, slots = ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  for k = 1, slots do
    redis.call('ZADD', KEYS[i], now + ttl, me .. '#' .. k)
    n = n + 1
  end
  redis.call('PEXPIRE', KEYS[i], 2 * ttl)
end
return n
"""

RELEASE = """
local me, slots = ARGV[1], tonumber(ARGV[2])
redis.call('ZREM', KEYS[1], me)
redis.call('ZREM', KEYS[2], me)
for i = 3, #KEYS do
  for k = 1, slots do
    redis.call('ZREM', KEYS[i], me .. '#' .. k)
  end
end
return 1
"""
