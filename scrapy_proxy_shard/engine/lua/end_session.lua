-- end_session.lua: end a sticky session now and give its proxy back to the site.
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV[1]  site    ARGV[2]  session id    ARGV[3]  min interval, ms
-- Replies:
--   {"OK", ended}  ended 1 if a live session existed

-- Arguments are checked before the first write (a repeat of this call changes nothing more).
local bad = check_strings({{1, 'site'}, {2, 'session id'}})
  or check_args({{3, 'min interval ms', 0, MAX_MS}})
if bad then return redis.error_reply(bad) end

local site, sid = ARGV[1], ARGV[2]
local interval = tonumber(ARGV[3])
local now = now_ms()
local S = session_key(site, sid)
local s = redis.call('HMGET', S, 'p', 'm')
redis.call('DEL', S)
if not s[1] or s[1] == '' then return {'OK', 0} end
redis.call('DEL', lease_key(site, s[2]))
redis.call('ZADD', ready_key(site), 'XX', next_free(site, s[1], now, interval), s[2])
announce_freed(site)
return {'OK', 1}
