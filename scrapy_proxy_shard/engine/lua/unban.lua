-- unban.lua: lift a quarantine now (strikes are forgotten too).
-- KEYS: bans banidx counters site ready
--        (roles in order, see engine/keyset.py: site/ready of the scope ARGV[1]; unused with "*")
-- ARGV[1]  scope: a site key, or "*" for the proxy-wide quarantine
-- ARGV[2]  proxy id
-- Replies:
--   {"OK", lifted}  lifted 1 if a quarantine entry existed, 0 if there was none
-- Slots that are held (a running lease or sticky session) keep their hold; free slots become usable
-- at once unless another quarantine of the proxy still runs (after a proxy-wide unban: within 30 s
-- on sites whose leases met the quarantine).

local scope, id = ARGV[1], ARGV[2]
local now = now_ms()
local field = scope .. '|' .. id
local cut = ban_entry_until(field) - now
if cut > 0 then redis.call('HINCRBY', K_COUNTERS, 'q_ms', -cut) end  -- mean quarantine: time served
local lifted = redis.call('HDEL', K_BANS, field)
redis.call('ZREM', K_BANIDX, field)
-- A site-wide quarantine pushed the proxy's slots on that site (hold_slots): bring them back. A
-- proxy-wide one was never pushed into the sites; leases that met it deferred it by at most
-- RECHECK_MS (lease.lua), so it is back everywhere within that time without a loop over sites.
if scope ~= '*' then
  local c = redis.call('HGET', K_SITE, 'c')
  if c then
    for k = 0, tonumber(c) - 1 do
      local member = id .. '/' .. k
      redis.call('ZADD', K_READY, 'XX', slot_free_at(scope, id, member, now), member)
    end
  end
end
return {'OK', lifted}
