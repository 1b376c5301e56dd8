-- host_beat.lua: a Scrapy process says "alive" to one pool, records its load, and reads a summary of
-- the pool for its periodic log line; dead hosts of the pool are forgotten on the way.
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV[1]  host id
-- ARGV[2]  host TTL, ms: the host counts as alive this long after this beat
-- ARGV[3]  info: a JSON object (spider, hostname, pid; never credentials), stored as given
-- ARGV[4]  "1": register the host even if it never leased from this pool; "0": only if it has
--          leases counted here or is registered already (lets a host beat in every pool it used)
-- ARGV[5]  load bucket width, ms (60000: leases per minute)
-- ARGV[6]  load history kept, ms (older buckets are deleted)
-- Replies:
--   {"OK", now_ms, proxies, live_hosts, leases, ok, err, banned, n_sites, site_1, slots_1, free_1, ...}
--        leases/ok/err/banned (responses judged a ban): this host's counters in this pool since it registered; slots/free: the
--        site's slots and how many are free right now
--   {"IDLE"}  ARGV[4] was "0" and the host has nothing to do with this pool: nothing was written
-- Cost: O(16 log N) (the 16 sites used most lately, see REPORT_SITES) plus at most 16 dead hosts
-- forgotten and one hour of this host's buckets
-- trimmed. Heartbeats are the only writers of P:hosts, P:host:*, P:load:*; no request path touches
-- them, so a lease or release costs nothing extra.

local host, ttl, info, always = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local bucket_ms, keep_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
local H = host_key(host)

if always ~= '1' and redis.call('HEXISTS', K_HSTATS, host .. ':l') == 0
    and not redis.call('ZSCORE', K_HOSTS, host) then
  return {'IDLE'}
end

-- Forget hosts whose heartbeat stopped (their counters go with them: memory stays bounded).
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', K_HOSTS, '-inf', now, 'LIMIT', 0, 16)) do
  if dead ~= host then
    redis.call('ZREM', K_HOSTS, dead)
    redis.call('DEL', host_key(dead), load_key(dead))
    forget_host_counters(dead)
  end
end

-- Load: leases counted by lease.lua since the previous beat go into the current minute's bucket.
local total = tonumber(redis.call('HGET', K_HSTATS, host .. ':l')) or 0
local seen = tonumber(redis.call('HGET', H, 'seen')) or 0
local delta = total - seen
if delta < 0 then delta = total end
local L = load_key(host)
if delta > 0 then
  redis.call('HINCRBY', L, istr(now - now % bucket_ms), delta)
end
for _, minute in ipairs(redis.call('HKEYS', L)) do
  if tonumber(minute) < now - keep_ms then redis.call('HDEL', L, minute) end
end
redis.call('PEXPIRE', L, keep_ms)

if redis.call('EXISTS', H) == 0 then redis.call('HSET', H, 'since', istr(now)) end
redis.call('HSET', H, 'beat', istr(now), 'seen', istr(total), 'info', info)
redis.call('PEXPIRE', H, ttl)
redis.call('ZADD', K_HOSTS, now + ttl, host)

local mine = host_counters(host)
local reply = {'OK', now, redis.call('HLEN', K_PROXIES), redis.call('ZCOUNT', K_HOSTS, '(' .. now, '+inf'),
  total, mine[2], mine[3], mine[4]}
-- The sites used most lately (at most REPORT_SITES: a broad crawl's thousands of sites would make
-- every beat cost sites x log N), and how many sites are live in all.
local REPORT_SITES = 16
local sites = redis.call('ZREVRANGEBYSCORE', K_SITEIDX, '+inf', '(' .. now, 'LIMIT', 0, REPORT_SITES)
reply[#reply + 1] = #sites
for _, site in ipairs(sites) do
  local ready = ready_key(site)
  reply[#reply + 1] = site
  reply[#reply + 1] = redis.call('ZCARD', ready)
  reply[#reply + 1] = redis.call('ZCOUNT', ready, '-inf', now)
end
return reply
