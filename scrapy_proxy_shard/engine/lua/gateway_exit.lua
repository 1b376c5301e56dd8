-- gateway_exit.lua: record the exit IP a gateway slot's token turned out to have; when another slot
-- holds the same IP now, count it and rotate this slot (a new token: a new IP at the provider).
-- KEYS: proxies counters gwexit   (roles in order, see engine/keyset.py)
-- ARGV[1]  proxy id (the slot's)
-- ARGV[2]  the URL the request went through (the stored URL without its #session= mark)
-- ARGV[3]  the exit IP the gateway reported for that request
-- ARGV[4]  how long the record lasts, ms (a provider keeps a session's IP for minutes)
-- ARGV[5]  a new token, used only when this slot shares its IP with another
-- Replies:
--   {"OK"}             recorded (the IP is this slot's alone)
--   {"SHARED", other}  slot `other` (its id) holds the IP with its current token: this slot was rotated
--   {"STALE"}          this slot's token changed since that request: nothing recorded
--   {"STATIC"}         not a gateway slot with a token          {"UNKNOWN"}  no such proxy
-- Cost: O(1).

local bad = arg_str(1, 'proxy id') or arg_str(2, 'sent url') or arg_str(3, 'exit ip')
  or arg_int(4, 'exit ttl ms', 1, MAX_MS) or arg_str(5, 'token')
if bad then return redis.error_reply(bad) end
if not string.match(ARGV[5], '^[a-z0-9]+$') then
  return redis.error_reply('ERR scrapy-proxy-shard: a session token is lower-case letters and digits')
end
local id, sent, ip, ttl, fresh = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local function token_of(url)
  local at = string.find(url, '#session=', 1, true)
  if not at then return nil, nil end
  return string.match(string.sub(url, at + 9), '^gw%.%x+%.%d+%.([a-z0-9]+)$'), string.sub(url, 1, at - 1)
end
local stored = redis.call('HGET', K_PROXIES, id)
if not stored then return {'UNKNOWN'} end
local token, head = token_of(stored)
if not token then return {'STATIC'} end
if head ~= sent then return {'STALE'} end
local now = now_ms()
local v = redis.call('HGET', K_GWEXIT, ip)
if v then
  local other, other_token, until_ms = string.match(v, '^([^|]+)|([^|]*)|(%d+)$')
  if other and other ~= id and tonumber(until_ms) > now then
    local theirs = redis.call('HGET', K_PROXIES, other)
    if theirs and token_of(theirs) == other_token then
      redis.call('HINCRBY', K_COUNTERS, 'gw_shared', 1)
      redis.call('HINCRBY', K_COUNTERS, 'gw_rot', 1)
      redis.call('HSET', K_PROXIES, id, (string.gsub(stored, token, fresh)))
      return {'SHARED', other}
    end
  end
end
redis.call('HSET', K_GWEXIT, ip, id .. '|' .. token .. '|' .. istr(now + ttl))
redis.call('PEXPIRE', K_GWEXIT, ttl * 2)
return {'OK'}
