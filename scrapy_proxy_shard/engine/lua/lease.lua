-- lease.lua: lease the proxy slot that has been free longest on a site, or continue a sticky session.
-- KEYS: memo proxies meta order bans pstats hstats sitestats counters siteidx site ready waiting session breaker gwbusy
--        (roles in order, see engine/keyset.py: memo = P:done:lease:<token>, site/ready/waiting/breaker
--        of ARGV[1], session = P:session:<site>:<ARGV[6]>)
-- A gateway slot (URL mark #session=gw.<gid>.<k>...: one session of a provider's plan, engine/gateway.py)
-- serves one request at a time across all sites, so a gateway of N sessions never has more than N
-- requests in flight (the plan's limit): its lease is recorded in P:gwbusy (id -> "token|expires_ms",
-- removed by its release) and a slot busy on another site is deferred GW_RECHECK_MS at a time.
-- ARGV[1]  site (exclusivity key: registrable domain or site group)
-- ARGV[2]  concurrency: slots per proxy on this site, used when the site is first built
-- ARGV[3]  lease TTL, ms (a holder that dies frees the slot after this)
-- ARGV[4]  token: random, unique per lease (release must present it)
-- ARGV[5]  host id of the caller (for per-host counters)
-- ARGV[6]  session id, or "" for a plain lease
-- ARGV[7]  session TTL, ms (sliding; only with a session id)
-- ARGV[8]  site idle TTL, ms: the site's state expires this long after its last hold ends
-- ARGV[9]  spacing, ms (optional; with concurrency > 1): the proxy's other slots on the site start no
--          sooner than this after the lease's start; 0 or absent: the site's last release's (ip_field)
-- ARGV[10] opening spread, ms (optional; 0: none): the first use of each proxy the site learns is
--          spread over this (the site's first interval: see learn() in _lib.lua)
-- Replies (flat arrays):
--   {"OK", id, url, member, token, expires_ms, now_ms, session_flag, rebound_flag}
--        session_flag 1: the lease is a use of a sticky session; rebound_flag 1: the session's
--        previous proxy was banned, dead or removed and the session now has this new proxy
--   {"WAIT", wait_ms, reason[, 1]}  nothing usable now; wait_ms until the earliest slot frees up.
--        A fourth element 1 (firm): nothing on the site can free sooner (no slot is held, so no
--        release can come; the site has learnt every proxy): only an operator's unban or add can,
--        so a caller whose deadline comes first may give up at once (crawl/liveness.py).
--        reason "pool": the earliest slot is cooling or quarantined: it frees exactly then;
--        "held": the earliest slot is leased: wait_ms is its lease expiry, but a release may free
--        it sooner (callers block on P:freed:<site> for at most wait_ms);
--        "session": the session's own proxy is in use or inside its pacing interval;
--        "breaker": the site's circuit breaker is open (wait_ms until probing starts; firm) or half-open
--        with its probe in flight (wait_ms until the probe lease expires; a release may come sooner)
--   {"EMPTY"}  the pool holds no proxies (P:order is empty). A site whose ready set was lost while its
--        hash survived (eviction, a partial restore) learns the pool again instead: never EMPTY then
--   {"MIGRATE"}  the pool was written by an older version: run PoolStore.migrate, then ask again
-- Never OK without a URL: a ready member whose proxy is missing from P:proxies (removed, or lost by
-- eviction or a failover while its site survived) is dropped, and one whose proxy is quarantined
-- proxy-wide is deferred (to the quarantine's end, re-checked at least every RECHECK_MS so an unban
-- reaches every site soon); at most SKIPS_PER_CALL of both per call, then another is picked. A
-- repeated call with the same token (a client retry) answers the first OK again without writing.
-- The arguments are trusted: the store (engine/store_lease.py) checks them before the call, and a
-- script or function is only ever called by the store built from the same source (the function's
-- name and the script's SHA carry its hash), so its layout cannot differ (checks here cost ~2 us).
-- Cost: O(log N) in the number of proxies (one ZRANGEBYSCORE LIMIT 1 + one ZADD). A site learns at
-- most LEARN_CHUNK slots of new proxies per call (see learn() in _lib.lua), so no call blocks Redis
-- for O(N) however large the pool or the number of sites.

local earlier = redis.call('GET', K_MEMO)
if earlier then
  -- (a release memo: the lease ran and was released since, which its caller cannot have done without
  -- its reply: never an OK again)
  earlier = lease_memo_reply(earlier, ARGV[4], tonumber(ARGV[3])) or {'WAIT', 1, 'pool'}
  -- The memo keeps no URL: look it up again; a WAIT if the proxy was removed meanwhile (never an OK
  -- without a URL).
  if earlier[1] == 'OK' then
    earlier[3] = redis.call('HGET', K_PROXIES, earlier[2])
    if not earlier[3] then return {'WAIT', 1, 'pool'} end
  end
  return earlier
end

local SKIPS_PER_CALL = 32
local RECHECK_MS = 30000
local GW_RECHECK_MS = 50
local site = ARGV[1]
local concurrency = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local token = ARGV[4]
local host = ARGV[5]
local sid = ARGV[6]
local session_ttl = tonumber(ARGV[7])
local idle = tonumber(ARGV[8])
local migrate, pool_seq = pool_layout()
if migrate then return {'MIGRATE'} end
local now, now_str = now_ms()
local ready = K_READY
local rebound = 0
local S = nil
-- The site's circuit breaker first: open, no lease on any host; half-open, this lease is the probe.
local breaker_wait, probing = nil, false
if redis.call('EXISTS', K_BREAKER) == 1 then  -- no key: closed (the breaker helpers are defined only here)
  --@lazy breaker_gate
  breaker_wait, probing = breaker_gate(site, now)
  if breaker_wait then return breaker_wait end
end

if sid ~= '' then
  S = K_SESSION
  local s = redis.call('HMGET', S, 'p', 'm', 'busy', 'next')
  if s[1] and s[1] ~= '' then
    local id, member = s[1], s[2]
    local usable = redis.call('HEXISTS', K_PROXIES, id) == 1 and blocked_until(site, id) <= now
    if usable then
      local busy, nxt = tonumber(s[3]), tonumber(s[4])
      if busy > now then return {'WAIT', busy - now, 'session'} end
      if nxt > now then return {'WAIT', nxt - now, 'session'} end
      local own_url = redis.call('HGET', K_PROXIES, id)
      local elsewhere = gw_busy(id, own_url, now)
      if elsewhere > 0 then return {'WAIT', math.min(elsewhere, GW_RECHECK_MS), 'session'} end
      gw_take(id, own_url, token, now + ttl, ttl)
      redis.call('HSET', S, 't', token, 'busy', now + ttl)
      redis.call('HINCRBY', S, 'n', 1)
      redis.call('PEXPIRE', S, session_ttl)
      redis.call('HSET', K_SITE, member, held_record(token, host, now, now + session_ttl, sid))
      -- Not below an overlap floor (see floor_field): the session may lapse before it.
      local hold = not_before_floor(now + session_ttl, redis.call('HGET', K_SITE, floor_field(member)))
      redis.call('ZADD', ready, 'XX', hold, member)
      count_lease(id, host)  -- before touch_site: the site's counters expire with it from their first write
      touch_site(site, now + session_ttl, idle, now)
      if probing then
        --@lazy breaker_probe_taken
        breaker_probe_taken(token, now + ttl)
      end
      return remember_lease(K_MEMO, {'OK', id, own_url, member, token, now + ttl, now, 1, 0}, now_str)
    end
    -- The session's proxy is banned, dead or removed: free its slot and bind a new proxy below.
    -- The binding is emptied rather than deleted, so a rebind that has to wait is still reported
    -- as a rebind when it completes.
    local b = blocked_until(site, id)
    if b < now then b = now end
    --@lazy drop_held
    b = drop_held(member, b)
    if redis.call('ZSCORE', ready, member) then
      redis.call('ZADD', ready, 'XX', b, member)
    end
    redis.call('HSET', S, 'p', '', 'm', '')
    redis.call('HINCRBY', S, 'rb', 1)
    redis.call('HINCRBY', K_COUNTERS, 'rebinds', 1)
    rebound = 1
  elseif s[1] == '' then
    rebound = 1
  end
end

local spread = tonumber(ARGV[10]) or 0
local site_c, built, deadline = ensure_site(site, concurrency, now, pool_seq, spread)
local found = redis.call('ZRANGEBYSCORE', ready, '-inf', now_str, 'LIMIT', 0, 1)
if #found == 0 and built and redis.call('EXISTS', ready) == 0 then
  -- The site's ready set is gone while its hash says every proxy was learnt (the set was evicted, or
  -- a partial restore brought back one key and not the other): learn the pool again from the start
  -- (learn() keeps each slot's live held record and quarantines), never answer EMPTY for it.
  redis.call('HSET', K_SITE, 'seq', 0)
  built = false
end
if #found == 0 and not built then  -- still learning: the free ones may be unlearnt: one more page
  site_c, built = ensure_site(site, concurrency, now, pool_seq, spread)
  deadline = nil  -- the ready set may be new: read the expiries
  found = redis.call('ZRANGEBYSCORE', ready, '-inf', now, 'LIMIT', 0, 1)
end
local url = nil
local skips = 0
while #found > 0 do
  local cand = id_of(found[1])
  -- (a slot above the site's slots per proxy: two learned in flight per IP were turned off, see
  -- conc_release in _pace.lua: it goes like a removed proxy's)
  url = (site_c > 1 or string.sub(found[1], -2) == '/0') and redis.call('HGET', K_PROXIES, cand)
  if url then
    local b = ban_entry_until('*|' .. cand)
    local elsewhere = 0
    if b <= now then
      elsewhere = gw_busy(cand, url, now)
      if elsewhere == 0 then break end
      b = now + math.min(elsewhere, GW_RECHECK_MS)  -- a gateway slot busy on another site: soon again
    end
    if b > now + RECHECK_MS then b = now + RECHECK_MS end
    redis.call('ZADD', ready, b, found[1])  -- quarantined proxy-wide: look again later
    url = nil
  else
    redis.call('ZREM', ready, found[1])  -- its proxy is gone from the pool
  end
  skips = skips + 1
  if skips >= SKIPS_PER_CALL then
    touch_site(site, now, idle, now)
    return {'WAIT', 1, 'pool'}
  end
  found = redis.call('ZRANGEBYSCORE', ready, '-inf', now, 'LIMIT', 0, 1)
end
if #found == 0 then
  local first = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
  touch_site(site, now, idle, now)
  if #first == 0 then
    if built then return {'EMPTY'} end
    return {'WAIT', 1, 'pool'}  -- a very large pool still being learnt: go on next call
  end
  local wait = tonumber(first[2]) - now
  if wait < 1 then wait = 1 end
  redis.call('SET', K_WAITING, '1', 'PX', 6000)
  if live_record(redis.call('HGET', K_SITE, first[1]), now) then return {'WAIT', wait, 'held'} end
  -- (never firm while a gateway slot is busy on another site: its release frees it here too)
  if built and not any_held(now) and redis.call('EXISTS', K_GWBUSY) == 0 then return {'WAIT', wait, 'pool', 1} end
  return {'WAIT', wait, 'pool'}
end

local member = found[1]
local id = id_of(member)
local hold = now + ttl
local lease_ttl = ttl
local session_flag = 0
if S then
  hold = now + session_ttl
  lease_ttl = session_ttl
  session_flag = 1
  redis.call('HSET', S, 'p', id, 'm', member, 't', token, 'busy', now + ttl, 'next', 0)
  redis.call('HINCRBY', S, 'n', 1)
  redis.call('PEXPIRE', S, session_ttl)
end
redis.call('ZADD', ready, hold, member)
redis.call('HSET', K_SITE, member, held_record(token, host, now, now + lease_ttl, sid))
gw_take(id, url, token, now + ttl, ttl)
local c = site_c
if c > 1 then
  -- Arrivals per IP: the proxy's other slots wait the site's spacing after this start (see ip_field).
  local spacing = tonumber(ARGV[9])
  if not spacing or spacing == 0 then spacing = tonumber(redis.call('HGET', K_SITE, IP_SPACING)) end
  space_ip_slots(id, member, c, now, spacing)
end
-- before touch_site: the site's counters expire with it from their first write
if count_lease(id, host) then deadline = nil end
touch_site(site, hold, idle, now, deadline)
if probing then
  --@lazy breaker_probe_taken
  breaker_probe_taken(token, now + ttl)
end
return remember_lease(K_MEMO, {'OK', id, url, member, token, now + ttl, now, session_flag, rebound}, now_str)
