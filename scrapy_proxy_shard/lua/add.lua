-- add.lua: add proxies to a pool (or update their tags); new proxies are usable at once on every
-- site the pool already serves.
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV     triples: proxy id, canonical URL, JSON tags ("" for none)
-- Replies:
--   {"OK", added, updated}

local now = now_ms()
local sites = redis.call('HGETALL', K_SITES)
local added, updated = 0, 0
for i = 1, #ARGV, 3 do
  local id, url, tags = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HSET', K_PROXIES, id, url) == 1 then
    added = added + 1
    for j = 1, #sites, 2 do
      local ready = ready_key(sites[j])
      local at = blocked_until(sites[j], id)
      if at < now then at = now end
      for k = 0, tonumber(sites[j + 1]) - 1 do
        redis.call('ZADD', ready, 'NX', at, id .. '/' .. k)
      end
    end
  else
    updated = updated + 1
  end
  if tags ~= '' then redis.call('HSET', K_TAGS, id, tags) else redis.call('HDEL', K_TAGS, id) end
end
return {'OK', added, updated}
