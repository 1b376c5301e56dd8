-- remove.lua: drain proxies out of a pool: no new leases from now on; leases and sessions that
-- hold one of them finish normally (their release finds no slot to free and is still counted).
-- Sites keep the proxy's members until a lease finds them first and drops them (lease.lua), so
-- a call costs O(log N) per proxy, whatever the number of sites.
-- KEYS: proxies tags pstats order   (roles in order, see engine/keyset.py)
-- ARGV     proxy ids
-- Replies:
--   {"OK", removed}

local removed = 0
for _, id in ipairs(ARGV) do
  if redis.call('HDEL', K_PROXIES, id) == 1 then
    removed = removed + 1
    redis.call('HDEL', K_TAGS, id)
    redis.call('HDEL', K_PSTATS, id .. ':l', id .. ':ok', id .. ':err', id .. ':ban', id .. ':lat')
    redis.call('ZREM', K_ORDER, id)
  end
end
return {'OK', removed}
