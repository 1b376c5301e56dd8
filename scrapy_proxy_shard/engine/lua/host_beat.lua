-- host_beat.lua: a Scrapy process says "alive" to one pool, records its load, and reads a summary of
-- the pool for its periodic log line; dead hosts of the pool are forgotten on the way.
-- KEYS: hosts hostinfo load hstats proxies siteidx   (roles in order, see engine/keyset.py)
-- ARGV[1]  host id
-- ARGV[2]  host TTL, ms: the host counts as alive this long after this beat
-- ARGV[3]  info: a JSON object (spider, hostname, pid; never credentials), stored as given
-- ARGV[4]  "1": register the host even if it never leased from this pool; "0": only if it has
--          leases counted here or is registered already (lets a host beat in every pool it used)
-- ARGV[5]  load bucket width, ms (60000: leases per minute)
-- ARGV[6]  load history kept, ms (older buckets are deleted)
-- ARGV[7]  instance token of the beating process ("" or absent: none, never refused): a live record
--          of this host id holding another token belongs to another process using the same id
-- Replies:
--   {"OK", now_ms, proxies, live_hosts, leases, ok, err, banned, n_sites, site_1, ..., site_n}
--        leases/ok/err/banned (responses judged a ban): this host's counters in this pool since it
--        registered; the sites used most lately (at most REPORT_SITES): the caller reads their slots
--        and free slots with sites.lua (their keys declared)
--   {"IDLE"}  ARGV[4] was "0" and the host has nothing to do with this pool: nothing was written
--   {"TAKEN", alive_until_ms, last_beat_ms}  another instance (token) beats as this host id and its
--        record is alive: nothing was written (the caller refuses to start, or waits for it to expire)
-- Cost: O(log N) plus at most 16 dead hosts forgotten and one hour of this host's buckets
-- trimmed. Heartbeats are the only writers of P:hosts, P:hostinfo, P:load; no request path touches
-- them, so a lease or release costs nothing extra.

local host, ttl, info, always = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local token = ARGV[7] or ''
local bucket_ms, keep_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()

local alive_until = tonumber(redis.call('ZSCORE', K_HOSTS, host))
if always ~= '1' and redis.call('HEXISTS', K_HSTATS, host .. ':l') == 0 and not alive_until then
  return {'IDLE'}
end

-- The host's record; one whose TTL ran out starts afresh (a new since, nothing seen, no owner).
local rec = nil
if alive_until and alive_until > now then
  local raw = redis.call('HGET', K_HOSTINFO, host)
  if raw then rec = cjson.decode(raw) end
end
if rec and token ~= '' and rec.token and rec.token ~= '' and rec.token ~= token then
  return {'TAKEN', alive_until, tonumber(rec.beat) or 0}
end
rec = rec or {since = istr(now), seen = '0'}
if token ~= '' then rec.token = token end

-- Forget hosts whose heartbeat stopped (their counters go with them: memory stays bounded).
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', K_HOSTS, '-inf', now, 'LIMIT', 0, 16)) do
  if dead ~= host then
    redis.call('ZREM', K_HOSTS, dead)
    forget_host(dead)
    forget_host_counters(dead)
  end
end


-- Load: leases counted by lease.lua since the previous beat go into the current minute's bucket.
local total = tonumber(redis.call('HGET', K_HSTATS, host .. ':l')) or 0
local seen = tonumber(rec.seen) or 0
local delta = total - seen
if delta < 0 then delta = total end
local raw_load = redis.call('HGET', K_LOAD, host)
local load = raw_load and cjson.decode(raw_load) or {}
local kept = {}
for minute, n in pairs(load) do
  if tonumber(minute) >= now - keep_ms then kept[minute] = n end
end
if delta > 0 then
  local minute = istr(now - now % bucket_ms)
  kept[minute] = (tonumber(kept[minute]) or 0) + delta
end
if next(kept) then
  redis.call('HSET', K_LOAD, host, cjson.encode(kept))
else
  redis.call('HDEL', K_LOAD, host)
end

rec.beat = istr(now)
rec.seen = istr(total)
rec.info = info
redis.call('HSET', K_HOSTINFO, host, cjson.encode(rec))
redis.call('ZADD', K_HOSTS, now + ttl, host)

-- the pool's URLs, read by every lease, back in the hashtable encoding after a restart (see as_table)
if redis.call('HLEN', K_PROXIES) > BIG_HASH then as_table(K_PROXIES) end
local mine = host_counters(host)
local reply = {'OK', now, redis.call('HLEN', K_PROXIES), redis.call('ZCOUNT', K_HOSTS, '(' .. now, '+inf'),
  total, mine[2], mine[3], mine[4]}
-- The sites used most lately (at most REPORT_SITES: a broad crawl's thousands of sites would make
-- every beat cost sites x log N).
local REPORT_SITES = 16
local sites = redis.call('ZREVRANGEBYSCORE', K_SITEIDX, '+inf', '(' .. now, 'LIMIT', 0, REPORT_SITES)
reply[#reply + 1] = #sites
for _, site in ipairs(sites) do reply[#reply + 1] = site end
return reply
