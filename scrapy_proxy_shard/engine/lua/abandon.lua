-- abandon.lua: settle a lease call whose reply never reached its caller (the client timed out, or the
-- connection broke, after sending it): the script may have run, or may still run later.
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV[1]  site the lease was asked for
-- ARGV[2]  token the lease call carried
-- Replies:
--   {"RELEASED"}  the lease had run and still held its slot: the slot is free again (no pacing rest:
--                 no request went out through it) and a waiter is woken
--   {"GONE"}      the lease had run but its slot is no longer held by it (expired or taken over)
--   {"BARRED"}    the lease has not run (or its memo is gone): its token is barred for 60 s, so a
--                 copy still queued in Redis answers WAIT and writes nothing
-- Idempotent: a second call finds the memo it left and answers the same.

local bad = check_strings({{1, 'site'}, {2, 'token'}})
if bad then return redis.error_reply(bad) end
local site, token = ARGV[1], ARGV[2]
local earlier = redis.call('GET', memo_key('abandon', token))
if earlier then return {earlier} end

local function settle(status)
  redis.call('SET', memo_key('abandon', token), status, 'PX', MEMO_MS)
  return {status}
end

local v = redis.call('GET', memo_key('lease', token))
if not v then
  remember('lease', token, {'WAIT', 1, 'pool'})
  return settle('BARRED')
end
local reply = cjson.decode(v)
if reply[1] ~= 'OK' then return settle('GONE') end
local id, member = reply[2], reply[4]
local L = lease_key(site, member)
local held = redis.call('GET', L)
if not held or string.sub(held, 1, #token + 1) ~= token .. '|' then return settle('GONE') end
local now = now_ms()
local sid = string.match(held, '^[^|]*|[^|]*|[^|]*|(.*)$') or ''
if sid ~= '' then
  -- A sticky session's use that never happened: the binding stays, the use ends now.
  local S = session_key(site, sid)
  if redis.call('HGET', S, 't') == token then redis.call('HSET', S, 'busy', 0) end
  return settle('RELEASED')
end
redis.call('DEL', L)
if redis.call('ZADD', ready_key(site), 'XX', 'CH', next_free(site, id, now), member) == 1 then
  announce_freed(site)
end
return settle('RELEASED')
