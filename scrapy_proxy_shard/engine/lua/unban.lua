-- unban.lua: lift a quarantine now (strikes are forgotten too).
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV[1]  scope: a site key, or "*" for the proxy-wide quarantine
-- ARGV[2]  proxy id
-- Replies:
--   {"OK", lifted}  lifted 1 if a quarantine entry existed, 0 if there was none
-- Slots that are held (a running lease or sticky session) keep their hold; free slots become usable
-- at once unless another quarantine of the proxy still runs.

local scope, id = ARGV[1], ARGV[2]
local now = now_ms()
local field = scope .. '|' .. id
local cut = ban_entry_until(field) - now
if cut > 0 then redis.call('HINCRBY', K_COUNTERS, 'q_ms', -cut) end  -- mean quarantine: time served
local lifted = redis.call('HDEL', K_BANS, field)
redis.call('ZREM', K_BANIDX, field)
local sites = {scope}
if scope == '*' then sites = redis.call('HKEYS', K_SITES) end
for _, site in ipairs(sites) do
  local c = redis.call('HGET', K_SITES, site)
  if c then
    local ready = ready_key(site)
    for k = 0, tonumber(c) - 1 do
      local member = id .. '/' .. k
      redis.call('ZADD', ready, 'XX', slot_free_at(site, id, member, now), member)
    end
  end
end
return {'OK', lifted}
