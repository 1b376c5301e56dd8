-- _lib.lua: helpers prepended to every operation script (scripts.py joins them before loading).
--
-- Key layout, all under one hash tag so a pool lives in one Redis Cluster slot. KEYS[1] is the pool
-- prefix "{namespace:pool}"; it is declared so the call is routed to the pool's slot, and every key
-- below is built from it (same hash tag, hence same slot):
--   P:proxies            HASH   proxy id -> canonical proxy URL (may hold credentials)
--   P:tags               HASH   proxy id -> JSON tags (type, provider, country; read by Python only)
--   P:sites              HASH   site -> slots per proxy on that site (= concurrency); marks the site's
--                               ready ZSET as built
--   P:ready:<site>       ZSET   member "<id>/<k>" (slot k of a proxy) -> ms from which it may be used
--   P:lease:<site>:<m>   STRING "token|host|issued_ms|session" with PX = lease or session TTL; exists
--                               exactly while slot m is held
--   P:session:<site>:<sid> HASH p=id m=member t=use token busy=ms next=ms n=uses rb=rebinds; PX TTL
--   P:bans               HASH   "<site>|<id>" (site "*" = proxy-wide) -> "until_ms|strikes|reason|since"
--   P:banidx             ZSET   "<site>|<id>" -> ms after which the entry (and its strikes) is forgotten
--   P:pstats             HASH   "<id>:<counter>" per proxy (l leases, ok, err, ban = quarantines
--                               started, lat = EWMA ms)
--   P:hstats             HASH   "<host>:<counter>" per host (l, ok, err, banned = responses judged a ban,
--                               stale, expired; ban is banned's name before the rename: read, never written)
--   P:sstats             HASH   "<site>:<counter>" per site (l, ok, err, banned = responses judged a ban,
--                               ban and ban:<reason> = quarantines started; site "*" = proxy-wide)
--   Every key suffix and counter field is named in schema.py too (tests/test_schema.py compares them).
--   P:counters           HASH   pool-wide counters (stale, expired, rebinds, q_started = quarantines
--                               started, q_ms = their total length in ms, less what unban cut short)
--   P:sitebuild          HASH   site -> HSCAN cursor of a ready ZSET still being built (see below)
--   P:waiting:<site>     STRING set (PX 6 s) whenever a lease on the site answers WAIT: releases
--                               announce on the freed list only while someone may be waiting
--   P:freed:<site>       LIST   one entry per slot given back on the site; waiters BLPOP it so a
--                               release wakes exactly one waiter on any host (at most 8 entries,
--                               gone after 60 s idle, so stale wake-ups stay few)
--   P:hosts              ZSET   host id -> ms until which the host counts as alive (its last heartbeat
--                               plus its PROXY_SHARD_HOST_TTL); written by heartbeats only (host_beat.lua)
--   P:host:<host>        HASH   beat=ms since=ms seen=leases counted at the last beat info=JSON; PX TTL
--   P:load:<host>        HASH   minute start ms -> leases the host took in that minute (one hour kept)
--   P:done:<op>:<token>  STRING the JSON reply of a write script already run for this token (PX 60 s): a
--                               resent call (redis-py retry_on_timeout) answers it again, writes nothing
--   P:meta               HASH   created=ms: the pool was loaded once; remove.lua never deletes it, so
--                               an empty pool without it was lost by Redis (FLUSHALL, failover, eviction)
--   P:pace:<site>        HASH   adaptive pacing: the site's learned interval (see "Adaptive pacing" below)
-- Times are milliseconds of the Redis server clock (TIME), so host clock skew cannot cause overlaps.

local P = KEYS[1]
local K_PROXIES = P .. ':proxies'
local K_TAGS = P .. ':tags'
local K_SITES = P .. ':sites'
local K_BANS = P .. ':bans'
local K_BANIDX = P .. ':banidx'
local K_PSTATS = P .. ':pstats'
local K_HSTATS = P .. ':hstats'
local K_SSTATS = P .. ':sstats'
local K_COUNTERS = P .. ':counters'

local K_META = P .. ':meta'

-- Upper bounds of every time and count argument, checked before the first write of any script: a
-- script that fails half way (SET PX with an overflowing expiry) would leave partial state behind.
local MAX_MS = 31622400000  -- 366 days
local MAX_CONCURRENCY = 1000

-- Check numeric arguments: spec rows {index, name, lowest, highest[, fraction allowed]}. Returns an
-- error message for the first bad one, or nil. Callers `return redis.error_reply(msg)` at once.
local function check_args(spec)
  for _, row in ipairs(spec) do
    local raw = ARGV[row[1]]
    local v = tonumber(raw)
    local bad = v == nil or v ~= v or v < row[3] or v > row[4]
    if not bad and not row[5] and v ~= math.floor(v) then bad = true end
    if bad then
      return 'ERR scrapy-proxy-shard: argument ' .. row[2] .. ' (' .. tostring(raw) .. ') must be a '
        .. (row[5] and 'number' or 'whole number') .. ' from ' .. tostring(row[3]) .. ' to ' .. tostring(row[4])
    end
  end
  return nil
end

-- Check string arguments: non-empty (or empty allowed), at most 200 bytes. Returns a message or nil.
local function check_strings(spec)
  for _, row in ipairs(spec) do
    local raw = ARGV[row[1]]
    if raw == nil or #raw > 200 or (raw == '' and not row[3]) then
      return 'ERR scrapy-proxy-shard: argument ' .. row[2] .. ' must be a string of 1 to 200 bytes'
    end
  end
  return nil
end

-- Idempotency of write scripts: the first reply for (op, token) is kept 60 s, longer than any
-- client retry (socket_timeout x retries), so a resent EVALSHA gets the same answer and writes nothing.
local MEMO_MS = 60000
local function memo_key(op, token) return P .. ':done:' .. op .. ':' .. token end
-- A reply holding a proxy URL is kept without it (URLs with credentials live in P:proxies only):
-- `url_at` is the URL's index and `url_at - 1` the proxy id's; recall looks the URL up again, and
-- answers a short WAIT if the proxy was removed meanwhile (never an OK without a URL).
local function recall(op, token, url_at)
  local v = redis.call('GET', memo_key(op, token))
  if not v then return nil end
  local reply = cjson.decode(v)
  if url_at then
    reply[url_at] = redis.call('HGET', K_PROXIES, reply[url_at - 1])
    if not reply[url_at] then return {'WAIT', 1, 'pool'} end
  end
  return reply
end
local function remember(op, token, reply, url_at)
  local kept = {}
  for i, x in ipairs(reply) do kept[i] = x end
  if url_at then kept[url_at] = '' end
  redis.call('SET', memo_key(op, token), cjson.encode(kept), 'PX', MEMO_MS)
  return reply
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function ready_key(site) return P .. ':ready:' .. site end
local function lease_key(site, member) return P .. ':lease:' .. site .. ':' .. member end
local function freed_key(site) return P .. ':freed:' .. site end

local function waiting_key(site) return P .. ':waiting:' .. site end

-- Wake one waiter (on any host) blocked on the site's freed list; a no-op (no writes) unless a
-- lease on the site answered WAIT in the last few seconds.
local function announce_freed(site)
  if redis.call('EXISTS', waiting_key(site)) == 0 then return end
  local key = freed_key(site)
  redis.call('LPUSH', key, '1')
  redis.call('LTRIM', key, 0, 7)
  redis.call('PEXPIRE', key, 60000)
end

local function session_key(site, sid) return P .. ':session:' .. site .. ':' .. sid end
local function id_of(member) return string.match(member, '^(.*)/%d+$') end

-- Integer as a decimal string (tostring would switch to exponent notation for big numbers).
local function istr(n) return string.format('%d', n) end

-- Until when a ban entry holds (0 when there is none).
local function ban_entry_until(field)
  local v = redis.call('HGET', K_BANS, field)
  if not v then return 0 end
  return tonumber(string.match(v, '^(%d+)|')) or 0
end

-- Until when a proxy may not be used on a site: the later of its site ban and its proxy-wide
-- quarantine.
local function blocked_until(site, id)
  local a = ban_entry_until(site .. '|' .. id)
  local b = ban_entry_until('*|' .. id)
  if b > a then return b end
  return a
end

-- A site's ready ZSET is built from the pool lazily, BUILD_CHUNK proxies (one HSCAN page) per call,
-- so no single call blocks Redis for O(N) however large the pool: P:sites gets the site at once (so
-- add/remove/ban see it), P:sitebuild holds the HSCAN cursor until the build is complete.
local BUILD_CHUNK = 1000
local K_SITEBUILD = P .. ':sitebuild'

-- Add one HSCAN page of the pool to the site; returns true when the build is complete.
local function build_chunk(site, concurrency, cursor, now)
  local count = math.max(1, math.floor(BUILD_CHUNK / concurrency))  -- about BUILD_CHUNK slots a page
  local res = redis.call('HSCAN', K_PROXIES, cursor, 'COUNT', count)
  local kv = res[2]
  local batch = {}
  for i = 1, #kv, 2 do
    local id = kv[i]
    local score = blocked_until(site, id)
    if score < now then score = now end
    for k = 0, concurrency - 1 do
      batch[#batch + 1] = score
      batch[#batch + 1] = id .. '/' .. k
      if #batch >= 2000 then  -- flushed inside the slot loop: unpack stays far below LUAI_MAXCSTACK
        redis.call('ZADD', ready_key(site), 'NX', unpack(batch))
        batch = {}
      end
    end
  end
  if #batch > 0 then redis.call('ZADD', ready_key(site), 'NX', unpack(batch)) end
  if res[1] == '0' then
    redis.call('HDEL', K_SITEBUILD, site)
    return true
  end
  redis.call('HSET', K_SITEBUILD, site, res[1])
  return false
end

-- Make sure the site exists and advance its build by one page if it is still building.
-- Returns the site's slot count per proxy and whether its build is complete.
local function ensure_site(site, concurrency, now)
  local c = redis.call('HGET', K_SITES, site)
  local cursor = '0'
  if c then
    c = tonumber(c)
    cursor = redis.call('HGET', K_SITEBUILD, site)
    if not cursor then return c, true end
  else
    c = concurrency
    redis.call('HSET', K_SITES, site, c)
  end
  return c, build_chunk(site, c, cursor, now)
end

-- Advance a site's build by one page (used when nothing built so far is free).
local function continue_build(site, now)
  local cursor = redis.call('HGET', K_SITEBUILD, site)
  if not cursor then return true end
  return build_chunk(site, tonumber(redis.call('HGET', K_SITES, site)), cursor, now)
end

-- Push every slot of a proxy on one site to at least `until_ms` (XX: never re-adds a removed proxy;
-- GT: never shortens a longer hold).
local function hold_slots(site, id, until_ms)
  local c = redis.call('HGET', K_SITES, site)
  if not c then return end
  local ready = ready_key(site)
  for k = 0, tonumber(c) - 1 do
    redis.call('ZADD', ready, 'XX', 'GT', until_ms, id .. '/' .. k)
  end
end

-- Forget ban entries whose strike window has passed (bounded work per call keeps memory bounded).
local function forget_old_bans(now)
  local old = redis.call('ZRANGEBYSCORE', K_BANIDX, '-inf', now, 'LIMIT', 0, 16)
  for _, field in ipairs(old) do
    redis.call('HDEL', K_BANS, field)
    redis.call('ZREM', K_BANIDX, field)
  end
end

-- Quarantine proxy `id` on `scope` (a site, or '*' for every site) with an escalating TTL.
-- A ban that arrives while the same quarantine still runs (several in-flight requests seeing one
-- ban) does not add a strike. Returns until_ms, strikes, and 1 if this call started the quarantine.
local function ban(scope, id, reason, base_ms, max_ms, jitter, window_ms, now)
  local field = scope .. '|' .. id
  local prev = redis.call('HGET', K_BANS, field)
  local strikes = 0
  if prev then
    local p_until, p_strikes = string.match(prev, '^(%d+)|(%d+)|')
    p_until = tonumber(p_until)
    p_strikes = tonumber(p_strikes)
    if p_until > now then return p_until, p_strikes, 0 end
    if now - p_until < window_ms then strikes = p_strikes end
  end
  strikes = strikes + 1
  local ttl = base_ms * math.pow(2, strikes - 1)
  if ttl > max_ms then ttl = max_ms end
  ttl = math.floor(ttl * (1 + jitter))
  if ttl < 1 then ttl = 1 end
  local until_ms = now + ttl
  redis.call('HSET', K_BANS, field, istr(until_ms) .. '|' .. strikes .. '|' .. reason .. '|' .. istr(now))
  redis.call('ZADD', K_BANIDX, until_ms + window_ms, field)
  redis.call('HINCRBY', K_COUNTERS, 'q_started', 1)
  redis.call('HINCRBY', K_COUNTERS, 'q_ms', ttl)
  if scope == '*' then
    for _, site in ipairs(redis.call('HKEYS', K_SITES)) do hold_slots(site, id, until_ms) end
  else
    hold_slots(scope, id, until_ms)
  end
  redis.call('HINCRBY', K_PSTATS, id .. ':ban', 1)
  redis.call('HINCRBY', K_SSTATS, scope .. ':ban', 1)
  redis.call('HINCRBY', K_SSTATS, scope .. ':ban:' .. reason, 1)
  forget_old_bans(now)
  return until_ms, strikes, 1
end

-- The ms from which a slot of a proxy being (re-)added may be used: not before a quarantine ends,
-- nor before a lease or sticky session that still holds the slot (its lease key) runs out. A proxy
-- removed and added again while a request holds it must not be handed out twice.
local function slot_free_at(site, id, member, now)
  local at = blocked_until(site, id)
  if at < now then at = now end
  local held = redis.call('PTTL', lease_key(site, member))
  if held > 0 and now + held > at then at = now + held end
  return at
end

-- The start (ms) of the use a lease key records ("token|host|issued_ms|session"), or nil.
local function lease_start(value)
  if not value then return nil end
  return tonumber(string.match(value, '^[^|]*|[^|]*|(%d+)|'))
end

-- The pacing law (start-to-start, the gap a site's rate limit counts): a slot whose use started at
-- `start` and was given back at `now` is free again at the later of start + interval (two starts at
-- least `interval` apart) and now + rest (an optional pause after each response). An unknown start
-- counts as now (the old rest-after-response law: never sooner than the site allows).
local function paced_at(start, interval_ms, now, rest_ms)
  local t = (start or now) + interval_ms
  if now + rest_ms > t then t = now + rest_ms end
  return t
end

-- The ms from which a given-back slot may be used again: `at` (see paced_at), and not before any
-- quarantine of the proxy ends.
local function next_free(site, id, at)
  local b = blocked_until(site, id)
  if b > at then return b end
  return at
end

-- Heartbeat keys (host_beat.lua, host_leave.lua, hosts.lua; see health.py).
local K_HOSTS = P .. ':hosts'
local function host_key(host) return P .. ':host:' .. host end
local function load_key(host) return P .. ':load:' .. host end

-- A host's counters in P:hstats, in reply order; ':ban' (the old name of ':banned', still in pools
-- written before the rename) is added into banned when read and deleted with the host.
local function host_counters(host)
  local c = redis.call('HMGET', K_HSTATS, host .. ':l', host .. ':ok', host .. ':err', host .. ':banned',
    host .. ':ban')
  return {tonumber(c[1]) or 0, tonumber(c[2]) or 0, tonumber(c[3]) or 0, (tonumber(c[4]) or 0) + (tonumber(c[5]) or 0)}
end
local function forget_host_counters(host)
  redis.call('HDEL', K_HSTATS, host .. ':l', host .. ':ok', host .. ':err', host .. ':banned', host .. ':ban',
    host .. ':stale', host .. ':expired')
end

-- ==== Adaptive pacing (PROXY_SHARD_AUTOTHROTTLE_*; the control law is argued in docs/pacing.md) ====
-- P:pace:<site> HASH: one site's learned start-to-start interval, shared by every host and kept across
-- host restarts (written by release.lua only, when the caller has autothrottle on for the site):
--   iv     the interval in force, ms (fractional)
--   chg    when iv last changed, ms      eff  chg + the interval before it: a start from eff on was
--          scheduled by a release that already used iv; an earlier one may still be at the old pace
--   run    clean answers to requests started at or after eff, since the last change or rate-ban vote
--   vote   the proxy id of a pending rate-ban vote at this pace ('' none)
--   probe  the proxy trying a lower interval ('' none), piv that interval (ms), pat when it began (ms),
--          pn its clean answers at piv so far
--   bad    the lowest interval known to fail (ms; 0: none yet): a failed probe's, or the one in force at
--          a raise; lowering stops at bad x (1 + PACE_MARGIN) until PACE_FORGET_RUN clean answers there
--          shrink bad by PACE_FORGET (the site may have loosened its rule)
--   prev   the interval before the last lowering, while that lowering is provisional (its first
--          PACE_LONE_RUN clean answers): a vote meanwhile goes back to prev instead of raising
--   up, down, back, fail, skip, forget   raises, lowerings, lowerings undone, failed probes, rate bans
--          that changed nothing, floors lowered (counters)
--   p:<id> the proxy's last answer on the site: 'c' clean, 'b' a ban of any reason
local PACE_UP = 1.5          -- a raise: interval x 1.5 (capped at the maximum)
local PACE_DOWN = 0.8       -- a probe tries interval x 0.8, never below the floor nor the minimum
local PACE_CLEAN_RUN = 5     -- clean answers at the pace before a probe starts
local PACE_PROBE_RUN_FIRST = 3  -- clean answers of the probe proxy at the lower interval that adopt it,
local PACE_PROBE_RUN = 10       -- ... once an interval is known to fail (near the rule: a stricter test)
local PACE_PROBE_MS = 60000  -- a probe that has not concluded after max(this, 20 x its interval) is dropped
local PACE_LONE_RUN = 20     -- clean answers at the pace that void a pending vote (it pointed at its proxy)
local PACE_MARGIN = 0.05
local PACE_FORGET_RUN = 1000
local PACE_FORGET = 0.95

local function pace_key(site) return P .. ':pace:' .. site end
local function pace_ms(x) return string.format('%.3f', x) end

-- Apply one answer to the site's learned interval. Returns the interval this release paces its slot
-- with (ms: the probe's lower interval for the probe proxy, else the interval in force), what
-- happened, and the interval in force (ms). What happened: '' (nothing changed), 'probe' (this proxy starts trying a lower interval), 'down' (a probe
-- succeeded: every host uses it), 'fail' (a probe met a rate ban: the interval stays), 'up', 'skip' (a
-- rate ban that raised nothing) or 'forget'. `start` is the answered request's start (ms, from its
-- lease key) or nil when unknown (an expired lease: learns nothing); `rate` is true for a ban the
-- caller classed as rate-type (PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS).
-- Lowering is tried on one proxy at a time (the probe), so a lower interval that breaks the site's
-- rule costs one rate ban, not one per proxy. Raising is for the interval in force: a rate ban there is
-- a *vote* when (1) its request started at or after eff (it was paced by the interval in force: one
-- event seen by several requests or hosts, all started before the raise it caused, is one raise) and
-- (2) its proxy's previous answer on the site was clean (a proxy that answered a ban, or nothing yet,
-- is suspect, not the pace). The second vote from another proxy raises (the first when the pool holds
-- one proxy); PACE_LONE_RUN clean answers at the pace void a pending vote: a ban that follows clean
-- answers from other proxies at the same interval points at its proxy, so one bad proxy never raises
-- the site's interval by itself.
local function pace_release(site, id, start, outcome, rate, start_ms, min_ms, max_ms, now)
  local K = pace_key(site)
  local s = redis.call('HMGET', K, 'iv', 'eff', 'run', 'bad', 'vote', 'probe', 'piv', 'pat', 'pn', 'prev', 'p:' .. id)
  local iv, eff = tonumber(s[1]), tonumber(s[2])
  local run, bad, vote = tonumber(s[3]) or 0, tonumber(s[4]) or 0, s[5] or ''
  local probe, piv, pat, pn = s[6] or '', tonumber(s[7]) or 0, tonumber(s[8]) or 0, tonumber(s[9]) or 0
  local prev, last = tonumber(s[10]), s[11]
  if not iv or not eff then
    iv, eff = start_ms, now
    redis.call('HSET', K, 'iv', pace_ms(iv), 'chg', istr(now), 'eff', istr(now), 'run', 0, 'bad', 0, 'vote', '',
      'probe', '')
  end
  local bounded = iv
  if bounded < min_ms then bounded = min_ms end
  if bounded > max_ms then bounded = max_ms end
  if bounded ~= iv then  -- the bounds were changed in the settings since the value was learned
    redis.call('HSET', K, 'iv', pace_ms(bounded), 'chg', istr(now), 'eff', istr(now + iv), 'run', 0, 'vote', '',
      'probe', '')
    iv, eff, run, vote, probe = bounded, now + iv, 0, '', ''
  end
  if not start then return iv, '', iv end
  local event = ''
  local function change(new, what)
    local before = ''
    if what == 'down' then before = pace_ms(iv) end  -- provisional until PACE_LONE_RUN clean answers
    redis.call('HSET', K, 'iv', pace_ms(new), 'chg', istr(now), 'eff', istr(now + iv), 'run', 0, 'vote', '',
      'probe', '', 'prev', before)
    redis.call('HINCRBY', K, what, 1)
    iv, event, probe = new, what, ''
  end
  if outcome == 'ok' and last ~= 'c' then redis.call('HSET', K, 'p:' .. id, 'c') end
  if outcome == 'ban' and last ~= 'b' then redis.call('HSET', K, 'p:' .. id, 'b') end

  if probe ~= '' and probe == id then
    -- The probe proxy's answer: its uses from the probe's start on are paced by piv.
    if outcome == 'ok' then
      if start >= pat then
        pn = pn + 1
        local needed = PACE_PROBE_RUN
        if bad == 0 then needed = PACE_PROBE_RUN_FIRST end
        if pn >= needed then change(piv, 'down') else redis.call('HSET', K, 'pn', pn) end
      end
    elseif outcome == 'ban' and rate and start >= pat then
      redis.call('HSET', K, 'bad', pace_ms(piv), 'probe', '')
      redis.call('HINCRBY', K, 'fail', 1)
      probe, bad, event = '', piv, 'fail'
    elseif outcome ~= 'unknown' then  -- another ban, an error, a dead proxy: no verdict on the pace
      redis.call('HSET', K, 'probe', '')
      probe = ''
    end
  elseif outcome == 'ok' then
    if start >= eff then
      run = run + 1
      local floor = min_ms
      if bad * (1 + PACE_MARGIN) > floor then floor = bad * (1 + PACE_MARGIN) end
      if probe ~= '' and now > pat + math.max(PACE_PROBE_MS, 20 * piv) then
        redis.call('HSET', K, 'probe', '')  -- its proxy was removed, or never came back
        probe = ''
      end
      if probe == '' and not prev and run >= PACE_CLEAN_RUN and iv > floor + 0.01 then  -- (0.01: iv is kept to 3 decimals)
        local new = iv * PACE_DOWN
        if new < floor then new = floor end
        redis.call('HSET', K, 'probe', id, 'piv', pace_ms(new), 'pat', istr(now), 'pn', 0, 'run', 0)
        probe, piv, event = id, new, 'probe'
      elseif probe == '' and bad > 0 and run >= PACE_FORGET_RUN then
        redis.call('HSET', K, 'bad', pace_ms(bad * PACE_FORGET), 'run', 0, 'vote', '')
        redis.call('HINCRBY', K, 'forget', 1)
        event = 'forget'
      elseif (vote ~= '' or prev) and run >= PACE_LONE_RUN then
        redis.call('HSET', K, 'run', run, 'vote', '', 'prev', '')
      else
        redis.call('HSET', K, 'run', run)
      end
    end
  elseif outcome == 'ban' and rate then
    local votes = start >= eff and last == 'c'
    if votes and prev then  -- a vote against a lowering still provisional: undo it, no raise
      if iv > bad then redis.call('HSET', K, 'bad', pace_ms(iv)) end
      change(prev, 'back')
    elseif votes and ((vote ~= '' and vote ~= id) or redis.call('HLEN', K_PROXIES) < 2) then
      local new = iv * PACE_UP
      if new > max_ms then new = max_ms end
      if iv > bad then redis.call('HSET', K, 'bad', pace_ms(iv)) end
      change(new, 'up')
    else
      if votes then redis.call('HSET', K, 'vote', id, 'run', 0) end
      redis.call('HINCRBY', K, 'skip', 1)
      event = 'skip'
    end
  end
  if probe ~= '' and probe == id then return piv, event, iv end
  return iv, event, iv
end
