-- gateway_rotate.lua: give a gateway slot a new session token (a new exit IP at the provider) after a
-- ban on a site, unless the gateway's fresh IPs keep failing there (then: quarantine). The count per
-- (gateway, site) is of rotations since the site's last clean answer through the gateway (release.lua
-- forgets it on an "ok"), within the window: a site that blocks every fresh IP spends it, one that
-- accepts fresh IPs does not.
-- KEYS: proxies counters gwrot   (roles in order, see engine/keyset.py)
-- ARGV[1]  proxy id (the slot's: it names the slot, not the token, see engine/gateway.py)
-- ARGV[2]  site (or site group) the ban was on
-- ARGV[3]  the URL the banned request went through (the stored URL without its #session= mark):
--          compare-and-set, so a ban reported with an older token rotates nothing twice
-- ARGV[4]  the new token (letters and digits, chosen by the caller)
-- ARGV[5]  rotations the gateway may make for the site with no clean answer between, within the window (>= 1)
-- ARGV[6]  the window, ms
-- Replies:
--   {"ROTATED", count}   the slot's URL now holds the new token; count: rotations for the site in the window
--   {"COOLDOWN", count, left_ms}  the budget is spent: nothing changed (the caller quarantines the slot
--                        on the site as for a static proxy); left_ms until the window ends
--   {"STALE"}            the slot's token changed since that request (another host rotated it): nothing to do
--   {"NOOP"}             a gateway without placeholder (a new IP per request): counted, nothing to change
--   {"STATIC"}           not a gateway slot          {"UNKNOWN"}  no such proxy in the pool
-- Cost: O(1).

local bad = arg_str(1, 'proxy id') or arg_str(2, 'site') or arg_str(3, 'sent url') or arg_str(4, 'token')
  or arg_int(5, 'rotations', 1, 1000000) or arg_int(6, 'window ms', 1, MAX_MS)
if bad then return redis.error_reply(bad) end
if not string.match(ARGV[4], '^[a-z0-9]+$') then
  return redis.error_reply('ERR scrapy-proxy-shard: a session token is lower-case letters and digits')
end
local id, site, sent, fresh = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local stored = redis.call('HGET', K_PROXIES, id)
if not stored then return {'UNKNOWN'} end
local at = string.find(stored, '#session=', 1, true)
if not at then return {'STATIC'} end
local head, slot = string.sub(stored, 1, at - 1), string.sub(stored, at + 9)
local gid, token = string.match(slot, '^gw%.(%x+)%.%d+%.?([a-z0-9]*)$')
if not gid then return {'STATIC'} end
if head ~= sent then return {'STALE'} end
local now = now_ms()
local window = tonumber(ARGV[6])
local field = gid .. '|' .. site
local count, since = 0, now
local v = redis.call('HGET', K_GWROT, field)
if v then
  local c, s = string.match(v, '^(%d+)|(%d+)$')
  if c and now - tonumber(s) < window then count, since = tonumber(c), tonumber(s) end
end
if count >= tonumber(ARGV[5]) then
  redis.call('HINCRBY', K_COUNTERS, 'gw_cool', 1)
  return {'COOLDOWN', count, since + window - now}
end
count = count + 1
redis.call('HSET', K_GWROT, field, istr(count) .. '|' .. istr(since))
redis.call('PEXPIRE', K_GWROT, window * 2)
redis.call('HINCRBY', K_COUNTERS, 'gw_rot', 1)
if token == '' then return {'NOOP', count} end
-- The token is letters and digits: no pattern magic in it, nor '%' in the replacement.
redis.call('HSET', K_PROXIES, id, (string.gsub(stored, token, fresh)))
return {'ROTATED', count}
