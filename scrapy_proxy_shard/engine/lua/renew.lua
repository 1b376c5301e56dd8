-- renew.lua: extend a lease that is still held (a download that outlives the lease TTL).
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV[1]  site    ARGV[2]  member    ARGV[3]  token
-- ARGV[4]  new TTL from now, ms
-- ARGV[5]  session id, or ""    ARGV[6]  session TTL, ms
-- Replies:
--   {"OK", expires_ms}  extended
--   {"STALE"}           the token no longer holds the slot (expired and re-leased, or expired)

-- Naturally idempotent (a repeat extends to about the same expiry), so no memo; arguments are checked
-- before the first write.
local bad = check_strings({{1, 'site'}, {2, 'member'}, {3, 'token'}, {5, 'session id', true}})
  or check_args({{4, 'ttl ms', 1, MAX_MS}, {6, 'session ttl ms', 1, MAX_MS}})
if bad then return redis.error_reply(bad) end

local site, member, token = ARGV[1], ARGV[2], ARGV[3]
local ttl = tonumber(ARGV[4])
local sid = ARGV[5]
local session_ttl = tonumber(ARGV[6])
local now = now_ms()
local L = lease_key(site, member)

if sid ~= '' then
  local S = session_key(site, sid)
  local s = redis.call('HMGET', S, 't', 'm')
  if s[1] ~= token or s[2] ~= member then return {'STALE'} end
  local hold = ttl
  if session_ttl > hold then hold = session_ttl end
  redis.call('HSET', S, 'busy', now + ttl)
  redis.call('PEXPIRE', S, hold)
  redis.call('PEXPIRE', L, hold)
  redis.call('ZADD', ready_key(site), 'XX', 'GT', now + hold, member)
  return {'OK', now + ttl}
end

local v = redis.call('GET', L)
if not v or string.sub(v, 1, #token + 1) ~= token .. '|' then return {'STALE'} end
redis.call('PEXPIRE', L, ttl)
redis.call('ZADD', ready_key(site), 'XX', 'GT', now + ttl, member)
return {'OK', now + ttl}
