-- remove.lua: drain proxies out of a pool: no new leases from now on; leases and sessions that
-- hold one of them finish normally (their release finds no slot to free and is still counted).
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV     proxy ids
-- Replies:
--   {"OK", removed}

local sites = redis.call('HGETALL', K_SITES)
local removed = 0
for _, id in ipairs(ARGV) do
  if redis.call('HDEL', K_PROXIES, id) == 1 then
    removed = removed + 1
    redis.call('HDEL', K_TAGS, id)
    redis.call('HDEL', K_PSTATS, id .. ':l', id .. ':ok', id .. ':err', id .. ':ban', id .. ':lat')
    for j = 1, #sites, 2 do
      local ready = ready_key(sites[j])
      for k = 0, tonumber(sites[j + 1]) - 1 do
        redis.call('ZREM', ready, id .. '/' .. k)
      end
    end
  end
end
return {'OK', removed}
