-- abandon.lua: settle a lease call whose reply never reached its caller (the client timed out, or the
-- connection broke, after sending it): the script may have run, or may still run later.
-- KEYS: memo lease_memo bans site ready waiting freed session
--        (roles in order, see engine/keyset.py: memo = P:done:abandon:<token>, lease_memo =
--        P:done:lease:<token>, per-site keys of ARGV[1], session = P:session:<site>:<ARGV[3]>)
-- ARGV[1]  site the lease was asked for
-- ARGV[2]  token the lease call carried
-- ARGV[3]  session id the lease call carried, or ""
-- Replies:
--   {"RELEASED"}  the lease had run and still held its slot: the slot is free again (no pacing rest:
--                 no request went out through it) and a waiter is woken
--   {"GONE"}      the lease had run but its slot is no longer held by it (expired or taken over)
--   {"BARRED"}    the lease has not run (or its memo is gone): its token is barred for 60 s, so a
--                 copy still queued in Redis answers WAIT and writes nothing
-- Idempotent: a second call finds the memo it left and answers the same.

local bad = arg_str(1, 'site') or arg_str(2, 'token') or arg_str(3, 'session id', true)
if bad then return redis.error_reply(bad) end
local site, token = ARGV[1], ARGV[2]
local earlier = redis.call('GET', K_MEMO)
if earlier then return {earlier} end

local function settle(status)
  redis.call('SET', K_MEMO, status, 'PX', MEMO_MS)
  return {status}
end

local v = redis.call('GET', K_LEASE_MEMO)
if not v then
  remember(K_LEASE_MEMO, {'WAIT', 1, 'pool'})
  return settle('BARRED')
end
local reply = lease_memo_reply(v, token, 0)
if not reply or reply[1] ~= 'OK' then return settle('GONE') end  -- (no reply: released since)
local id, member = reply[2], reply[4]
local now = now_ms()
local held = live_record(redis.call('HGET', K_SITE, member), now)
if not held_with(held, token) then return settle('GONE') end
local _, sid = held_by(held)
if sid ~= '' then
  -- A sticky session's use that never happened: the binding stays, the use ends now. The session
  -- is the one the lease call named (ARGV[3], declared in KEYS): the record carries the same id.
  if sid == ARGV[3] and redis.call('HGET', K_SESSION, 't') == token then redis.call('HSET', K_SESSION, 'busy', 0) end
  return settle('RELEASED')
end
if redis.call('ZADD', K_READY, 'XX', 'CH', drop_held(member, next_free(site, id, now)), member) == 1 then
  announce_freed()
end
return settle('RELEASED')
