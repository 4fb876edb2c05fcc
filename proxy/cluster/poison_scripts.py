"""The Lua scripts that keep the replicas' shared memory of poison requests in Redis
(``proxy.cluster.poison``). Each runs atomically in Redis, so two replicas judging the same key at once
never lose a strike; time is Redis's own (``TIME``), so the replicas' clocks never matter. Every script
publishes what it changed on ``CHANNEL``, which every replica listens to.

Keys (one hash tag, ``{poison}``, so a script may touch them all in a Redis Cluster too):

- ``llamagate:{poison}:bodies``: the refused bodies, a sorted set of sha256 digests (hex) scored by until
  when they are refused, in ms; at most ``max_bodies`` (the soonest to end go first, as in a replica's
  own memory);
- ``llamagate:{poison}:cooling``: the keys that cool down, key ids scored the same way;
- ``llamagate:{poison}:strikes:<key id>``: a key's strikes within the window, one member per strike
  (an id the replica draws) scored by when, in ms; it expires with the window.

Each set expires with its last member (``PEXPIRE`` pushed on, never pulled in), so Redis holds nothing
past the longest cool-down.

STRIKE (KEYS: bodies, cooling, strikes of the key; ARGV: origin, key id, digest, strike id, strikes,
window_ms, cooldown_ms, max_bodies, channel) refuses the body for ``cooldown_ms``, counts the strike
and, at ``strikes`` within ``window_ms``, cools the key down for ``cooldown_ms`` (its strikes start
over). Publishes ``{o, s=1, k, d, b=cooldown_ms, c=cooldown_ms or 0}``. Answer: the key's cool-down in ms,
0 when it does not cool down.

SYNC (KEYS: bodies, cooling; ARGV: origin, channel, max_bodies, n bodies, then n (digest, ms left) pairs,
then (key id, ms left) pairs) adds what one replica judged while Redis was out of its reach (an entry
already there keeps the later end), publishes what that changed (``{o, m=1, bodies, keys}``), and answers
everything refused now: ``{{digest, ms left, ...}, {key id, ms left, ...}}``.
"""

from __future__ import annotations

PREFIX = "llamagate:{poison}"
BODIES = f"{PREFIX}:bodies"
COOLING = f"{PREFIX}:cooling"
CHANNEL = f"{PREFIX}:verdicts"


def strikes_key(key_id: str) -> str:
    return f"{PREFIX}:strikes:{key_id}"


# Sets a key's expiry to at least ``ms`` from now (a set created by ZADD has none yet).
_KEEP = """
local function keep(key, ms)
  local left = redis.call('PTTL', key)
  if left < ms then redis.call('PEXPIRE', key, ms) end
end
local function trim(key, now, most)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local extra = redis.call('ZCARD', key) - most
  if extra > 0 then redis.call('ZREMRANGEBYRANK', key, 0, extra - 1) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

STRIKE = (
    _KEEP
    + """
local origin, key, digest, id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local strikes, window, cooldown = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local max_bodies, channel = tonumber(ARGV[8]), ARGV[9]
redis.call('ZADD', KEYS[1], 'GT', now + cooldown, digest)
trim(KEYS[1], now, max_bodies)
keep(KEYS[1], cooldown)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now - window))
redis.call('ZADD', KEYS[3], now, id)
keep(KEYS[3], window + 1)
local cooled = 0
if redis.call('ZCARD', KEYS[3]) >= strikes then
  redis.call('DEL', KEYS[3])
  redis.call('ZADD', KEYS[2], 'GT', now + cooldown, key)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  keep(KEYS[2], cooldown)
  cooled = cooldown
end
local said = {o = origin, s = 1, k = key, d = digest, b = cooldown, c = cooled}
redis.call('PUBLISH', channel, cjson.encode(said))
return cooled
"""
)

SYNC = (
    _KEEP
    + """
local origin, channel, max_bodies, n = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local added = {bodies = {}, keys = {}}
local changed = false
for i = 5, #ARGV, 2 do
  local which, list = KEYS[1], added.bodies
  if i >= 5 + 2 * n then which, list = KEYS[2], added.keys end
  local ms = tonumber(ARGV[i + 1])
  if redis.call('ZADD', which, 'GT', 'CH', now + ms, ARGV[i]) == 1 then
    keep(which, ms)
    table.insert(list, {ARGV[i], ms})
    changed = true
  end
end
trim(KEYS[1], now, max_bodies)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if changed then
  redis.call('PUBLISH', channel, cjson.encode({o = origin, m = 1, bodies = added.bodies, keys = added.keys}))
end
local out = {}
for j = 1, 2 do
  local flat = {}
  local all = redis.call('ZRANGE', KEYS[j], 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    table.insert(flat, all[i])
    table.insert(flat, tonumber(all[i + 1]) - now)
  end
  out[j] = flat
end
return out
"""
)
