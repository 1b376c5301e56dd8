-- migrate.lua: one page of the migration of a pool written before sites learnt proxies lazily
-- (layout 1: a P:sites hash of sites, no P:order, ready ZSETs without expiry). PoolStore.migrate
-- drives it: it HSCANs P:proxies and P:sites a page at a time and passes each page here with every
-- key declared; each step is idempotent, so two hosts migrating at once do no harm.
-- ARGV[1]  step:
--   "proxies"  KEYS: P:order, P:meta; ARGV[2..] proxy ids: give each id without one an add number
--   "sites"    KEYS: P:siteidx, then P:site:<site>, P:ready:<site> per site; ARGV[2] site idle TTL, ms;
--              ARGV[3..] (site, slots per proxy) pairs: old sites get a P:site hash, an expiry and a
--              P:siteidx entry (a site already on the new layout is left alone)
--   "done"     KEYS: P:meta, P:sites, P:sitebuild: the old hashes go, P:meta layout=2
-- Replies: {"OK", n}  n: ids numbered / sites migrated (0 for "done")

local step = ARGV[1]
local n = 0
if step == 'proxies' then
  for i = 2, #ARGV do
    if not redis.call('ZSCORE', KEYS[1], ARGV[i]) then
      redis.call('ZADD', KEYS[1], redis.call('HINCRBY', KEYS[2], 'seq', 1), ARGV[i])
      n = n + 1
    end
  end
elseif step == 'sites' then
  local bad = arg_int(2, 'site idle ttl ms', 1000, MAX_MS)
  if bad then return redis.error_reply(bad) end
  if #KEYS ~= 1 + (#ARGV - 2) or (#ARGV - 2) % 2 ~= 0 then
    return redis.error_reply('ERR scrapy-proxy-shard: migrate sites takes P:siteidx and a key pair per site')
  end
  local idle = tonumber(ARGV[2])
  local now = now_ms()
  for j = 3, #ARGV, 2 do
    if redis.call('EXISTS', KEYS[j - 1]) == 0 then  -- KEYS[j - 1]: the site's hash, KEYS[j]: its ready ZSET
      redis.call('HSET', KEYS[j - 1], 'c', ARGV[j + 1], 'seq', 0)
      redis.call('PEXPIRE', KEYS[j - 1], idle)
      redis.call('PEXPIRE', KEYS[j], idle)
      redis.call('ZADD', KEYS[1], now + idle, ARGV[j])
      n = n + 1
    end
  end
elseif step == 'done' then
  redis.call('DEL', KEYS[2], KEYS[3])
  redis.call('HSET', KEYS[1], 'layout', '2')
  redis.call('HDEL', KEYS[1], 'mstep', 'mcursor')
else
  return redis.error_reply('ERR scrapy-proxy-shard: migrate step must be proxies, sites or done')
end
return {'OK', n}
