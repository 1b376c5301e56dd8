-- end_session.lua: end a sticky session now and give its proxy back to the site.
-- KEYS: bans site ready waiting freed session
--        (roles in order, see engine/keyset.py: per-site keys of ARGV[1], session = P:session:<site>:<ARGV[2]>)
-- The slot is no longer held once the session ends (its ready score is the pacing or quarantine
-- end, which the pool's ban entries keep even if the site's state expires): no site refresh needed.
-- ARGV[1]  site    ARGV[2]  session id
-- ARGV[3]  pacing interval, ms, for a use still in flight (its start + this); a session whose last
--          use was released goes back at the `next` that release computed (start-to-start pacing,
--          rest after response, randomization already applied)
-- Replies:
--   {"OK", ended}  ended 1 if a live session existed

-- Arguments are checked before the first write (a repeat of this call changes nothing more).
local bad = arg_str(1, 'site') or arg_str(2, 'session id')
  or arg_int(3, 'min interval ms', 0, MAX_MS)
if bad then return redis.error_reply(bad) end

local site, sid = ARGV[1], ARGV[2]
local interval = tonumber(ARGV[3])
local now = now_ms()
local S = K_SESSION
local s = redis.call('HMGET', S, 'p', 'm', 'busy', 'next')
redis.call('DEL', S)
if not s[1] or s[1] == '' then return {'OK', 0} end
local at = now
if tonumber(s[3]) == 0 then
  at = tonumber(s[4]) or now
  if at < now then at = now end
else  -- a use is in flight (or its holder died): pace from its start
  at = paced_at(lease_start(redis.call('HGET', K_SITE, s[2])), interval, now, 0)
end
redis.call('ZADD', K_READY, 'XX', drop_held(s[2], next_free(site, s[1], at)), s[2])
announce_freed()
return {'OK', 1}
