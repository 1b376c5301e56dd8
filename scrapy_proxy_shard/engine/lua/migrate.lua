-- migrate.lua: one page of the migration of a pool written before sites learnt proxies lazily
-- (layout 1: a P:sites hash of sites, no P:order, ready ZSETs without expiry). PoolStore.migrate
-- drives it: it HSCANs P:proxies and P:sites a page at a time and passes each page here with every
-- key declared; each step is idempotent, so two hosts migrating at once do no harm.
-- ARGV[1]  step:
--   "proxies"  KEYS: P:order, P:meta; ARGV[2..] proxy ids: give each id without one an add number
--   "sites"    KEYS: P:siteidx, then P:site:<site>, P:ready:<site> per site; ARGV[2] site idle TTL, ms;
--              ARGV[3..] (site, slots per proxy) pairs: old sites get a P:site hash, an expiry and a
--              P:siteidx entry (a site already on the new layout is left alone)
--   "rekey"    KEYS: P:proxies, P:tags, P:order, P:meta, P:bans, P:banidx; ARGV[2] warm-up ms, ARGV[3] n,
--              then n quads (old id, exit id, URL as stored, URL as now canonical), then pairs (ban field
--              of an old id, the same field of its exit id). Layout 2 hashed a proxy's URL into its id, so
--              one exit listed with two credentials was two proxies: each goes under its exit id (the
--              first URL met for an exit stays), keeps its tags and bans (the later of two wins), and
--              rests the warm-up proxy-wide (reason "rekeyed"): a request sent through its old id may
--              still run, and the new id's slots know nothing of it. An id whose URL changed since
--              the scan is left for the next migration.
--   "done"     KEYS: P:meta, P:sites, P:sitebuild: the old hashes go, P:meta layout=3
-- Replies: {"OK", n}  n: ids numbered / sites migrated / ids re-keyed (0 for "done")

local step = ARGV[1]
local n = 0

-- The end (ms) of a P:bans entry "until|strikes|reason|since", -1 for none.
local function until_of(entry)
  return entry and tonumber(string.match(entry, '^(%d+)')) or -1
end
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
elseif step == 'rekey' then
  local bad = arg_int(2, 'rekey warm-up ms', 0, MAX_MS) or arg_int(3, 'rekey count', 0, 100000)
  if bad then return redis.error_reply(bad) end
  local warm, count = tonumber(ARGV[2]), tonumber(ARGV[3])
  if #KEYS ~= 6 or #ARGV < 3 + 4 * count or (#ARGV - 3 - 4 * count) % 2 ~= 0 then
    return redis.error_reply('ERR scrapy-proxy-shard: migrate rekey takes 6 keys, id quads and ban field pairs')
  end
  local now = now_ms()
  local moved = {}
  for j = 4, 3 + 4 * count, 4 do
    local old, new, stored, url = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
    if redis.call('HGET', KEYS[1], old) == stored then
      moved[old] = true
      local tags = redis.call('HGET', KEYS[2], old)
      redis.call('HDEL', KEYS[1], old)
      redis.call('HDEL', KEYS[2], old)
      redis.call('ZREM', KEYS[3], old)
      if redis.call('HSETNX', KEYS[1], new, url) == 1 then
        if tags then redis.call('HSET', KEYS[2], new, tags) end
        redis.call('ZADD', KEYS[3], redis.call('HINCRBY', KEYS[4], 'seq', 1), new)
      end
      local field = '*|' .. new
      if warm > 0 and until_of(redis.call('HGET', KEYS[5], field)) < now + warm then
        redis.call('HSET', KEYS[5], field, istr(now + warm) .. '|0|rekeyed|' .. istr(now))
        redis.call('ZADD', KEYS[6], 'GT', now + warm, field)  -- GT still adds a new member
      end
      n = n + 1
    end
  end
  for j = 4 + 4 * count, #ARGV, 2 do
    local from, to = ARGV[j], ARGV[j + 1]
    local old = string.match(from, '|([^|]*)$')
    local entry = redis.call('HGET', KEYS[5], from)
    if entry and old and moved[old] then
      local forget = redis.call('ZSCORE', KEYS[6], from)
      redis.call('HDEL', KEYS[5], from)
      redis.call('ZREM', KEYS[6], from)
      if until_of(entry) > until_of(redis.call('HGET', KEYS[5], to)) then
        redis.call('HSET', KEYS[5], to, entry)
        if forget then redis.call('ZADD', KEYS[6], 'GT', forget, to) end
      end
    end
  end
  bans_expire(KEYS[5], KEYS[6], now)
elseif step == 'done' then
  redis.call('DEL', KEYS[2], KEYS[3])
  redis.call('HSET', KEYS[1], 'layout', '3')
  redis.call('HDEL', KEYS[1], 'mstep', 'mcursor')
else
  return redis.error_reply('ERR scrapy-proxy-shard: migrate step must be proxies, sites or done')
end
return {'OK', n}
