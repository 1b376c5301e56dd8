-- site_state.lua: how many slots of a site are free, held, cooling or quarantined right now.
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV[1]  site
-- Replies:
--   {"OK", slots, free, held, cooling_or_banned, next_free_in_ms}
--   {"UNKNOWN"}  the site has not been used with this pool yet
-- O(N) in the pool size: for operators and tests, not for the request path.

local site = ARGV[1]
local c = redis.call('HGET', K_SITES, site)
if not c then return {'UNKNOWN'} end
local now = now_ms()
local ready = ready_key(site)
local slots = redis.call('ZCARD', ready)
local free = redis.call('ZCOUNT', ready, '-inf', now)
local held = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', ready, '(' .. now, '+inf')) do
  if redis.call('EXISTS', lease_key(site, member)) == 1 then held = held + 1 end
end
local first = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
local next_in = 0
if #first > 0 and tonumber(first[2]) > now then next_in = tonumber(first[2]) - now end
return {'OK', slots, free, held, slots - free - held, next_in}
