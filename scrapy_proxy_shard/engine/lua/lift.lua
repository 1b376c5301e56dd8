-- lift.lua: a local fallback lease whose adoption met another live lease on its slot (hold.lua's
-- BUSY in flight: an overlap during the outage, which set the slot's overlap floor) has ended. Its
-- part of the floor ends now, not at the end of its lease TTL: the floor drops to the latest end of
-- the slot's other overlapping leases still running, or goes. If the Redis holder has released the
-- slot already (its release readied it at the floor), the slot is readied again at the later of
-- now + ARGV[4] (the ended request's pacing), a quarantine's end and the remaining floor (only ever
-- sooner than before). A slot held again meanwhile keeps its score: its holder's release paces it.
-- KEYS: bans site ready   (roles in order, see engine/keyset.py; per-site keys of ARGV[1])
-- ARGV[1]  site    ARGV[2]  member "<id>/<k>"    ARGV[3]  token of the hold.lua call that was BUSY
-- ARGV[4]  gap, ms: how long the slot rests after the ended request (its min interval, rest)
-- Replies:
--   {"OK", ready_ms}  the slot's ready score now (0: no such slot)

local bad = arg_str(1, 'site') or arg_str(2, 'member') or arg_str(3, 'token') or arg_int(4, 'gap ms', 0, MAX_MS)
if bad then return redis.error_reply(bad) end
local site, member, token, gap = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = now_ms()
local ends = overlap_ends(member, now)
ends[token] = nil
set_overlap_ends(member, ends)
local rest = 0
for _, at in pairs(ends) do
  if at > rest then rest = at end
end
local rec = redis.call('HMGET', K_SITE, member, floor_field(member))
if rec[2] then
  if rest > now then
    redis.call('HSET', K_SITE, floor_field(member), string.format('%d', rest))
  else
    redis.call('HDEL', K_SITE, floor_field(member))
  end
end
if live_record(rec[1], now) then
  return {'OK', tonumber(redis.call('ZSCORE', K_READY, member)) or 0}
end
local id = id_of(member)
if not id then return {'OK', 0} end
local at = next_free(site, id, not_before_floor(now + gap, rest > now and rest or nil))
redis.call('ZADD', K_READY, 'XX', 'LT', at, member)
return {'OK', tonumber(redis.call('ZSCORE', K_READY, member)) or 0}
