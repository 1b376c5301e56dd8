-- add.lua: add proxies to a pool (or update their tags); new proxies are usable on every site the
-- pool already serves from that site's next lease on, as soon as nothing holds their slots.
-- Cost: O(log N) per proxy, whatever the number of sites.
-- KEYS: meta proxies tags bans banidx order   (roles in order, see engine/keyset.py)
-- ARGV[1]  mode: "add", or "restore" (only into a pool that Redis lost: P:meta absent and no proxies;
--          a pool an operator emptied with remove keeps P:meta and is left alone)
-- ARGV[2]  restore warm-up, ms: restored proxies are quarantined proxy-wide this long (reason
--          "restored"), so a request another host sent through one of them before Redis lost the
--          pool can finish first (the held records were lost with the pool)
-- ARGV[3..] triples: proxy id, canonical URL, JSON tags ("" for none). The id names the exit
--          (host:port, a declared session): a URL for an id already in the pool replaces its URL
--          in place (new credentials, the other scheme), and the exit's slots, pacing and bans stay;
--          a gateway slot (#session=gw.<gid>.<k>.<token>) keeps the token it has in the pool.
-- Replies:
--   {"OK", added, updated, replaced id...}   replaced: the ids (among the updated) whose URL changed
--   {"KEPT"}  restore mode only: the pool was not lost; nothing written
-- A proxy removed and added again while a request or sticky session still holds one of its slots
-- gets that slot back only when the holder's record runs out or is released (learn()), and
-- never before a quarantine of the proxy ends.

local bad = arg_int(2, 'restore warm-up ms', 0, MAX_MS)
if bad then return redis.error_reply(bad) end
if (#ARGV - 2) % 3 ~= 0 then return redis.error_reply('ERR scrapy-proxy-shard: add takes id, url, tags triples') end
local mode = ARGV[1]
local now = now_ms()
if mode == 'restore' then
  if redis.call('EXISTS', K_META) == 1 or redis.call('HLEN', K_PROXIES) > 0 then return {'KEPT'} end
elseif mode ~= 'add' then
  return redis.error_reply('ERR scrapy-proxy-shard: add mode must be add or restore')
end
local warm = tonumber(ARGV[2])
if redis.call('EXISTS', K_META) == 0 then redis.call('HSET', K_META, 'created', istr(now), 'layout', '3') end
local added, updated = 0, 0
local replaced = {}
for i = 3, #ARGV, 3 do
  local id, url, tags = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local old = redis.call('HGET', K_PROXIES, id)
  if old and old ~= url then
    -- A gateway slot already in the pool keeps its token (its exit IP, maybe rotated since): a host
    -- that starts later, with new random tokens, changes nothing but the credentials around it.
    local kept = string.match(old, '#session=gw%.%x+%.%d+%.([a-z0-9]+)$')
    local given = string.match(url, '#session=gw%.%x+%.%d+%.([a-z0-9]+)$')
    if kept and given then url = string.gsub(url, given, kept) end
    if old ~= url then replaced[#replaced + 1] = id end
  end
  if redis.call('HSET', K_PROXIES, id, url) == 1 then
    added = added + 1
    if mode == 'restore' and warm > 0 then
      local field = '*|' .. id
      redis.call('HSET', K_BANS, field, istr(now + warm) .. '|0|restored|' .. istr(now))
      redis.call('ZADD', K_BANIDX, now + warm, field)
    end
    -- Sites learn of it at their next lease (learn() in _lib.lua): no loop over sites here.
    redis.call('ZADD', K_ORDER, redis.call('HINCRBY', K_META, 'seq', 1), id)
  else
    updated = updated + 1
  end
  if tags ~= '' then redis.call('HSET', K_TAGS, id, tags) else redis.call('HDEL', K_TAGS, id) end
end
if mode == 'restore' and warm > 0 then bans_expire(K_BANS, K_BANIDX, now) end
if added > 0 and redis.call('HLEN', K_PROXIES) > BIG_HASH then as_table(K_PROXIES) end  -- read per lease
return {'OK', added, updated, unpack(replaced)}
