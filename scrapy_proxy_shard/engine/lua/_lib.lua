-- _lib.lua: helpers prepended to every operation script (scripts.py joins them before loading).
--
-- Key layout, all under one hash tag {namespace:pool} (written P below) so a pool lives in one Redis
-- Cluster slot. No script builds a key name: the caller declares every key a script touches in
-- KEYS (engine/keyset.py builds them; the order of each script is in its header, "KEYS: role ...",
-- and scripts.py prepends it as KEY_ROLES, bound below to the K_<ROLE> locals). Per-site keys are
-- those of the call's site; a slot is named by member "<id>/<k>" (slot k of a proxy).
--   P:proxies            HASH   proxy id -> canonical proxy URL (may hold credentials)
--   P:tags               HASH   proxy id -> JSON tags (type, provider, country; read by Python only)
--   P:order              ZSET   proxy id -> its add number (P:meta seq counts them): sites learn the
--                               pool's proxies in this order, a page per lease (see learn() below)
--   P:site:<site>        HASH   c = slots per proxy on the site (= concurrency), seq = add number the
--                               site has learnt up to, and one field per held slot: member ->
--                               "token|host|issued_ms|expires_ms|session" (a lease or a sticky
--                               session's binding); the record is live while expires_ms > now (the
--                               ready score says the same); release deletes it, an expired one is
--                               overwritten at the slot's next lease. Expires with the site (touch_site)
--   P:siteidx            ZSET   site -> ms at which its state expires: the live sites (status, beats)
--   P:ready:<site>       ZSET   member -> ms from which it may be used; expires, with P:site:<site>,
--                               PROXY_SHARD_SITE_IDLE_TTL after the site's last hold ends
--   P:session:<site>:<sid> HASH p=id m=member t=use token busy=ms next=ms n=uses rb=rebinds; PX TTL
--   P:bans               HASH   "<site>|<id>" (site "*" = proxy-wide) -> "until_ms|strikes|reason|since"
--   P:banidx             ZSET   "<site>|<id>" -> ms after which the entry (and its strikes) is forgotten;
--                               both keys expire with their latest entry (bans_expire)
--   P:pstats             HASH   "<id>:<counter>" per proxy (l leases, ok, err, ban = quarantines
--                               started, lat = EWMA ms)
--   P:hstats             HASH   "<host>:<counter>" per host (l, ok, err, banned = responses judged a ban,
--                               stale, expired; ban is banned's name before the rename: read, never written)
--   P:sitestats:<site>   HASH   the site's counters (l, ok, err, banned = responses judged a ban, ban and
--                               ban:<reason> = quarantines started, brk_*); expires with the site's
--                               state (touch_site), so a site touched once costs nothing once idle
--   P:sstats             HASH   "*:<counter>": proxy-wide quarantines started (ban, ban:<reason>)
--   Every key suffix and counter field is named in schema.py too (tests/test_schema.py compares them).
--   P:counters           HASH   pool-wide counters (stale, expired, rebinds, q_started = quarantines
--                               started, q_ms = their total length in ms, less what unban cut short)
--   P:waiting:<site>     STRING set (PX 6 s) whenever a lease on the site answers WAIT: releases
--                               announce on the freed list only while someone may be waiting
--   P:freed:<site>       LIST   one entry per slot given back on the site; waiters BLPOP it so a
--                               release wakes exactly one waiter on any host (at most 8 entries,
--                               gone after 60 s idle, so stale wake-ups stay few)
--   P:hosts              ZSET   host id -> ms until which the host counts as alive (its last heartbeat
--                               plus its PROXY_SHARD_HOST_TTL); written by heartbeats only (host_beat.lua)
--   P:hostinfo           HASH   host id -> JSON {beat, since, seen = leases counted at the last beat,
--                               info}; forgotten with the host (a dead host: by the next beat of another)
--   P:load               HASH   host id -> JSON {minute start ms: leases the host took} (one hour kept)
--   P:done:<op>:<token>  STRING the reply of a write script already run for this token (PX 60 s): a
--                               resent call (redis-py retry_on_timeout) answers it again, writes nothing;
--                               a lease and its release share P:done:lease:<token> (see remember_lease)
--   P:meta               HASH   created=ms: the pool was loaded once; remove.lua never deletes it, so
--                               an empty pool without it was lost by Redis (FLUSHALL, failover, eviction);
--                               seq = last add number; layout=3 (a pool written by an older version,
--                               P:sites without P:order, or proxy ids hashed from URLs rather than
--                               exits, is migrated by PoolStore.migrate: lease.lua and hold.lua answer
--                               MIGRATE until then)
--   P:pace:<site>        HASH   adaptive pacing: the site's learned interval (see "Adaptive pacing" below)
--   P:links, P:linkev, P:linkban  HASH  site groups learned from bans (see site_link.lua)
-- Times are milliseconds of the Redis server clock (TIME), so host clock skew cannot cause overlaps.

-- K_<ROLE> locals (K_MEMO, K_PROXIES, ... K_BRKSEEN, K_LEASE_MEMO: the role in capitals) are bound to
-- KEYS by scripts.py, which puts before each script only the helpers below that it uses (and their own
-- helpers), then `local K_<ROLE> = KEYS[i]` for the roles they touch, after checking #KEYS against the
-- script's roles (keyset.ROLES): a script runs no definition it never calls.

-- Upper bounds of every time and count argument, checked before the first write of any script: a
-- script that fails half way (SET PX with an overflowing expiry) would leave partial state behind.
local MAX_MS = 31622400000  -- 366 days
local MAX_CONCURRENCY = 1000

-- Argument checks, chained with `or` at the top of a script (`local bad = arg_str(1, 'site') or
-- arg_int(2, 'concurrency', 1, MAX_CONCURRENCY) or ...`; then `if bad then return redis.error_reply(bad)
-- end`): each returns an error message for a bad argument, or nil. No table is built per call (a
-- release checks 22 arguments on every call).
-- ARGV[i] a whole number from lo to hi (arg_int), or any number from lo to hi (arg_num).
local function arg_bad(i, name, lo, hi, what)
  return 'ERR scrapy-proxy-shard: argument ' .. name .. ' (' .. tostring(ARGV[i]) .. ') must be a ' .. what
    .. ' from ' .. tostring(lo) .. ' to ' .. tostring(hi)
end
local function arg_int(i, name, lo, hi)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= v or v < lo or v > hi or v ~= math.floor(v) then return arg_bad(i, name, lo, hi, 'whole number') end
  return nil
end
local function arg_num(i, name, lo, hi)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= v or v < lo or v > hi then return arg_bad(i, name, lo, hi, 'number') end
  return nil
end
-- ARGV[i] a string of 1 to 200 bytes (0 to 200 when `empty` is true).
local function arg_str(i, name, empty)
  local raw = ARGV[i]
  if raw == nil or #raw > 200 or (raw == '' and not empty) then
    return 'ERR scrapy-proxy-shard: argument ' .. name .. ' must be a string of 1 to 200 bytes'
  end
  return nil
end

-- Idempotency of write scripts: the first reply for (op, token) is kept 60 s, longer than any
-- client retry (socket_timeout x retries), so a resent EVALSHA gets the same answer and writes nothing.
local MEMO_MS = 60000
-- The memo key is declared by the caller (K_MEMO: this call's, "P:done:<op>:<token>").
-- A reply holding a proxy URL is kept without it (URLs with credentials live in P:proxies only):
-- `url_at` is the URL's index; the script that recalls it looks the URL up again (lease.lua, hold.lua).
local function recall(memo)
  local v = redis.call('GET', memo)
  if not v then return nil end
  return cjson.decode(v)
end
local function remember(memo, reply, url_at)
  local kept = {}
  for i, x in ipairs(reply) do kept[i] = x end
  if url_at then kept[url_at] = '' end
  redis.call('SET', memo, cjson.encode(kept), 'PX', MEMO_MS)
  return reply
end

local function id_of(member) return string.match(member, '^(.*)/%d+$') end

-- The Redis clock in ms: a number, and the same as a decimal string made from TIME's digits (for the
-- memos below: formatting a number costs more than the string work).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t[1] .. string.sub('00000' .. t[2], -6, -4)
end

-- The memo of a lease and its release: one key per lease token (P:done:lease:<token>, declared by
-- both), written by the lease and overwritten by the release (overwriting a key costs Redis far less
-- than creating one), kept MEMO_MS after each write, in a compact form built without cjson or number
-- formatting (the costliest parts of a memo):
--   "L|<now_ms>|<session_flag>|<rebound_flag>|<member>"  lease.lua's OK reply (the URL, token and
--        expiry are not kept: a resent call carries the same token and TTL, the URL is looked up again)
--   "R|<status>|<now_ms>"   a release reply without ban, breaker or pacing fields
--   "R" .. JSON             any other release reply; a JSON array alone: abandon.lua's bar (WAIT)
--   and memos written by an older version
-- The lease reply a memo stands for (nil for a release memo): token and TTL are the call's.
local function lease_memo_reply(v, token, ttl)
  if string.sub(v, 1, 2) == 'L|' then
    local now, flag, rebound, member = string.match(v, '^L|(%d+)|(%d)|(%d)|(.*)$')
    now = tonumber(now)
    return {'OK', id_of(member), '', member, token, now + ttl, now, tonumber(flag), tonumber(rebound)}
  end
  if string.sub(v, 1, 1) == 'R' then return nil end
  return cjson.decode(v)
end
local function remember_lease(memo, reply, now_str)
  redis.call('SET', memo, 'L|' .. now_str .. '|' .. (reply[8] == 1 and '1' or '0') .. '|'
    .. (reply[9] == 1 and '1' or '0') .. '|' .. reply[4], 'PX', MEMO_MS)
  return reply
end
-- The release reply a memo holds (nil for a lease memo or abandon.lua's bar).
local function release_memo_reply(v)
  if string.sub(v, 1, 2) == 'R|' then
    local status, now, free = string.match(v, '^R|(%u+)|(%d+)|?(%d*)$')
    return {status, tonumber(now), 0, 0, '', 0, 0, '', 0, 0, '', '', '0.000', '', tonumber(free) or 0}
  end
  if string.sub(v, 1, 1) == 'R' then return cjson.decode(string.sub(v, 2)) end
  return nil
end
local function remember_release(memo, reply, now_str)
  local plain = reply[3] == 0 and reply[4] == 0 and reply[5] == '' and reply[11] == '' and reply[12] == ''
    and reply[13] == '0.000' and reply[14] == ''
  if plain and #reply == 15 then
    redis.call('SET', memo, 'R|' .. reply[1] .. '|' .. now_str .. '|' .. string.format('%d', reply[15]), 'PX', MEMO_MS)
  else
    redis.call('SET', memo, 'R' .. cjson.encode(reply), 'PX', MEMO_MS)
  end
  return reply
end

-- Wake one waiter (on any host) blocked on the site's freed list; a no-op (no writes) unless a
-- lease on the site answered WAIT in the last few seconds.
local function announce_freed()
  if redis.call('EXISTS', K_WAITING) == 0 then return end
  redis.call('LPUSH', K_FREED, '1')
  redis.call('LTRIM', K_FREED, 0, 7)
  redis.call('PEXPIRE', K_FREED, 60000)
end


-- A hash read field by field on every call (a site's held records, its pace marks, the pool's URLs)
-- is kept in Redis's hashtable encoding once it may grow big. Redis keeps a hash of up to
-- hash-max-listpack-entries fields (512 by default) as a listpack, where finding a field is a linear
-- scan and a field that is not there scans it all: with 500 proxies a release's reads of a site's
-- hash and pace hash cost ~20 us of Redis time, more than all its other commands. A value longer
-- than hash-max-listpack-value (64 by default) converts the hash, and Redis never converts it back
-- (until a restart loads it from disk: then the next site built, or the next add or host beat for the
-- pool's URLs, converts again): written and deleted at once, it leaves no field behind.
local BIG_HASH = 64
local function as_table(key)
  redis.call('HSET', key, '~encoding~', string.rep('~', 2048))
  redis.call('HDEL', key, '~encoding~')
end

-- A site's hash holds one record per slot in use: it grows with the crawl's concurrency on the site,
-- and a site touched a few times should stay a small listpack (a hashtable costs ~200 B more). A
-- release checks its size now and then (1 in 8, by the Redis clock's ms) until it converted it (field
-- ht; forgotten at each refresh of the site's expiry, so a restart that loaded it back as a listpack is
-- caught within a quarter of the idle TTL). `ht` is the field as the release read it.
local function site_as_table(ht, now)
  if ht or now % 8 ~= 0 then return end
  if redis.call('HLEN', K_SITE) > BIG_HASH then
    as_table(K_SITE)
    redis.call('HSET', K_SITE, 'ht', '1')
  end
end

-- Integer as a decimal string (tostring would switch to exponent notation for big numbers).
local function istr(n) return string.format('%d', n) end

-- Held slots: a record "token|host|issued_ms|expires_ms|session" in the site's hash (K_SITE) under
-- the slot's member. The session id comes last: it may hold any printable character.
local function held_record(token, host, issued, expires, sid)
  return token .. '|' .. host .. '|' .. istr(issued) .. '|' .. istr(expires) .. '|' .. sid
end
-- The record's expiry (ms), or 0 for none.
local function held_until(value)
  if not value then return 0 end
  return tonumber(string.match(value, '^[^|]*|[^|]*|[^|]*|(%d+)|')) or 0
end
-- The record if it is live now (else nil).
local function live_record(value, now)
  if value and held_until(value) > now then return value end
  return nil
end
-- Whether a record was written for the lease with this token.
local function held_with(value, token)
  return value ~= nil and value ~= false and string.sub(value, 1, #token + 1) == token .. '|'
end
-- The start (ms) of the use a held record records, or nil.
local function lease_start(value)
  if not value then return nil end
  return tonumber(string.match(value, '^[^|]*|[^|]*|(%d+)|'))
end
-- The host and session id of a record.
local function held_by(value)
  local host, sid = string.match(value, '^[^|]*|([^|]*)|[^|]*|[^|]*|(.*)$')
  return host or '', sid or ''
end

-- Leases (lease.lua; defined here so the Functions library defines them once, not at every call).
-- A gateway slot (URL mark #session=gw.<gid>.<k>...) serves one request at a time across all sites:
-- the ms until its request on another site ends (0: free, or not a gateway slot).
local function gw_busy(id, url, now)
  if not string.find(url, '#session=gw.', 1, true) then return 0 end
  local v = redis.call('HGET', K_GWBUSY, id)
  local u = v and tonumber(string.match(v, '|(%d+)$'))
  if u and u > now then return u - now end
  return 0
end
local function gw_take(id, url, token, until_ms, ttl_ms)
  if string.find(url, '#session=gw.', 1, true) then
    redis.call('HSET', K_GWBUSY, id, token .. '|' .. istr(until_ms))
    -- the hash outlives its longest lease, no more: a record a dead holder left goes with it
    if redis.call('PTTL', K_GWBUSY) < ttl_ms then redis.call('PEXPIRE', K_GWBUSY, ttl_ms) end
  end
end

-- Whether some slot of the site is held now (a live lease or sticky session record in K_SITE): its
-- release may free a slot before the earliest ready score. A site hash of more than HELD_SCAN fields
-- counts as held unread (the WAIT stays a plain one): the check is bounded.
local HELD_SCAN = 66
local function any_held(at)
  local n = redis.call('HLEN', K_SITE)
  if n <= 2 then return false end  -- 'c' and 'seq' only
  if n > HELD_SCAN then return true end
  local h = redis.call('HGETALL', K_SITE)
  for i = 1, #h, 2 do
    local f = h[i]
    if f ~= 'c' and f ~= 'seq' and string.sub(f, -1) ~= '^' and live_record(h[i + 1], at) then return true end
  end
  return false
end

-- Count a lease; true when the site's counters hash was (likely) just created: it has no expiry yet.
local function count_lease(id, host)
  redis.call('HINCRBY', K_PSTATS, id .. ':l', 1)
  redis.call('HINCRBY', K_HSTATS, host .. ':l', 1)
  return redis.call('HINCRBY', K_SITESTATS, 'l', 1) == 1
end

-- Until when a ban entry's value ("until_ms|strikes|reason|since") holds (0 for none).
local function entry_until(v)
  if not v then return 0 end
  return tonumber(string.match(v, '^(%d+)|')) or 0
end

-- Until when the ban entry `field` holds (0 when there is none).
local function ban_entry_until(field)
  return entry_until(redis.call('HGET', K_BANS, field))
end

-- Until when a proxy may not be used on a site: the later of its site ban and its proxy-wide
-- quarantine (both entries in one read).
local function blocked_until(site, id)
  local e = redis.call('HMGET', K_BANS, site .. '|' .. id, '*|' .. id)
  local a, b = entry_until(e[1]), entry_until(e[2])
  if b > a then return b end
  return a
end

-- Several slots per proxy on a site (its 'c' > 1): the site counts arrivals per IP, so a lease of one
-- slot keeps the proxy's other slots at least the site's spacing (ms, under IP_SPACING, the interval
-- the last release paced with) after its start, and the start is kept under ip_field(id) for the
-- release of a slot that was in flight meanwhile (release.lua).
local IP_SPACING = '@iv'
local function ip_field(id)
  return '@' .. id
end

-- The IP of slot `member` (proxy `id`, `c` slots on the site) reached the site at `at` at the latest
-- (a lease's start; a late use's latest arrival, release.lua): its other slots start no sooner than
-- `spacing` ms after (never sooner than they were due), and `at` is kept under ip_field(id).
local function space_ip_slots(id, member, c, at, spacing)
  redis.call('HSET', K_SITE, ip_field(id), istr(at))
  if not spacing or spacing <= 0 then return end
  local others = {}
  for j = 0, c - 1 do
    local sibling = id .. '/' .. j
    if sibling ~= member then
      others[#others + 1] = at + spacing
      others[#others + 1] = sibling
    end
  end
  if #others > 0 then redis.call('ZADD', K_READY, 'XX', 'GT', unpack(others)) end
end

-- Sites learn the pool lazily, so no call costs sites x proxies: P:order numbers every proxy by
-- when it was added (P:meta seq is the last number given out); a site's hash P:site:<site> holds its
-- slots per proxy (c) and the number up to which it has taken proxies into its ready ZSET (seq).
-- Each lease on a site takes in at most LEARN_CHUNK slots of proxies it has not seen yet: a new
-- site is built that way page by page, and a proxy added later reaches every site at its next
-- lease. Removed proxies leave their members behind; a lease drops them when they come first.
local LEARN_CHUNK = 32  -- ~0.1 ms a page; a site touched a few times stays a listpack ZSET (<= 128)

-- Take up to LEARN_CHUNK slots of proxies added after the site's cursor into its ready ZSET. Each
-- new member waits for a live held record of its slot (a proxy removed and added again while held,
-- or a pool restored while the site's state survived) and for the proxy's quarantines. Returns true
-- when the site has seen every proxy.
-- The opening spread (`spread` ms, the site's first interval; 0: none): each proxy's first slot is
-- free at now + frac(its add number / the pool's + the site's phase `ph`) x spread. A site's first
-- round of requests is spread over the interval it would take anyway (each IP serves it once per
-- interval), not sent in one burst at the first lease; and since every site's phase differs (see
-- ensure_site), one IP's first requests to the sites a crawl opens at once are far apart: two
-- sites behind one blacklist see no IP twice at once before the crawl can learn they share it
-- (crawl/links.py), and independent sites lose nothing.
local function learn(site, c, seq, pool_seq, now, spread, ph)
  if seq >= pool_seq then return true end
  local count = math.max(1, math.floor(LEARN_CHUNK / c))
  local got = redis.call('ZRANGEBYSCORE', K_ORDER, '(' .. istr(seq), '+inf', 'WITHSCORES', 'LIMIT', 0, count)
  if #got > 0 then
    -- Bulk reads, not a call per slot: the proxies' two ban entries, and the slots' held records.
    local fields, members = {}, {}
    for i = 1, #got, 2 do
      fields[#fields + 1] = site .. '|' .. got[i]
      fields[#fields + 1] = '*|' .. got[i]
      for k = 0, c - 1 do members[#members + 1] = got[i] .. '/' .. k end
    end
    local bans = redis.call('HMGET', K_BANS, unpack(fields))
    local held = {}
    for j = 1, #members, 2000 do  -- unpack stays far below LUAI_MAXCSTACK
      local part = redis.call('HMGET', K_SITE, unpack(members, j, math.min(j + 1999, #members)))
      for n, v in ipairs(part) do held[j + n - 1] = v end
    end
    -- Several slots per proxy: a slot k >= 1 of a proxy whose first slot is known (the site's slots
    -- per proxy were raised: learned concurrency, see conc_release in _pace.lua) is free no sooner than
    -- that slot's live use's start + the site's spacing, or when it is not in use, than that slot (its
    -- ready score: its pacing and quarantines): the site counts arrivals per IP, and the new slot must
    -- not add one too soon.
    local first, spacing = {}, 0
    if c > 1 then
      local heads = {}
      for i = 1, #got, 2 do heads[#heads + 1] = got[i] .. '/0' end
      first = redis.call('ZMSCORE', K_READY, unpack(heads))
      spacing = tonumber(redis.call('HGET', K_SITE, IP_SPACING)) or 0
    end
    local batch, slot = {}, 0
    for i = 1, #got, 2 do
      local id = got[i]
      local free_at = now
      if spread > 0 then
        free_at = now + math.floor(((tonumber(got[i + 1]) / pool_seq + ph) % 1) * spread)
      end
      for _, entry in ipairs({bans[i], bans[i + 1]}) do
        local u = entry_until(entry)
        if u > free_at then free_at = u end
      end
      local head = slot + 1  -- the proxy's first slot's index in members/held
      local head_at = tonumber(first[(i + 1) / 2])
      local head_start = lease_start(live_record(held[head], now))
      for k = 0, c - 1 do
        slot = slot + 1
        local at = free_at
        local until_ms = held_until(held[slot])
        if until_ms > at then at = until_ms end
        if k > 0 then  -- (a held first slot's score is its lease's expiry: its start counts instead)
          if head_start then
            if head_start + spacing > at then at = head_start + spacing end
          elseif head_at and head_at > at then
            at = head_at
          end
        end
        batch[#batch + 1] = at
        batch[#batch + 1] = id .. '/' .. k
        if #batch >= 2000 then  -- flushed inside the slot loop: unpack stays far below LUAI_MAXCSTACK
          redis.call('ZADD', K_READY, 'NX', unpack(batch))
          batch = {}
        end
      end
      seq = tonumber(got[i + 1])
    end
    if #batch > 0 then redis.call('ZADD', K_READY, 'NX', unpack(batch)) end
  end
  if #got < 2 * count then seq = pool_seq end  -- nothing more: proxies removed since were skipped
  redis.call('HSET', K_SITE, 'seq', istr(seq))
  return seq >= pool_seq
end

-- Count one `field` in the call's site counters (P:sitestats:<site>), from a call that may not touch
-- the site (a ban by an operator, a breaker's or a content check's change): a counters hash with no
-- expiry gets SITESTATS_KEEP_MS, so counters of a site nobody leases again never stay. A site in use
-- gives them its own idle expiry (touch_site).
local SITESTATS_KEEP_MS = 86400000
local function site_stat(field)
  redis.call('HINCRBY', K_SITESTATS, field, 1)
  if redis.call('PTTL', K_SITESTATS) == -1 then redis.call('PEXPIRE', K_SITESTATS, SITESTATS_KEEP_MS) end
end

-- Keep a site's state alive while it is used: its keys (ready ZSET, site hash with the held records,
-- its counters) expire SITE idle ms after the last hold ends (`until_ms`), so an idle site costs
-- nothing; P:siteidx lists live sites by that expiry. The ready ZSET and the site hash are created in
-- the call that first touches the site and always get the same expiry; the counters hash is checked
-- too (first written by a call that does not touch the site, it may carry another keep time: see
-- site_stat). Refreshed only when a quarter of the idle time has been used up. Every call that starts or
-- extends a hold calls it, so a site's state (its held records with it) never expires while a slot is
-- held. The site hash keeps when the keys expire (field 'x', ms, written at each refresh): a caller that
-- read it (`deadline`: a lease, by ensure_site's read of the hash) saves the two PTTLs otherwise read.
local function touch_site(site, until_ms, idle, now, deadline)
  local want = until_ms - now + idle
  local left
  if deadline then
    left = deadline - now
  else
    left = redis.call('PTTL', K_READY)
    local counted = redis.call('PTTL', K_SITESTATS)  -- -2: no counter yet (nothing to expire)
    if counted ~= -2 and counted < left then left = counted end
  end
  if left >= 0 and left > want - math.floor(idle / 4) then return end
  redis.call('HSET', K_SITE, 'x', istr(now + want))  -- before the PEXPIREs: never a hash without expiry
  redis.call('HDEL', K_SITE, 'ht')  -- (its encoding is checked again: see site_as_table)
  redis.call('PEXPIRE', K_READY, want)
  redis.call('PEXPIRE', K_SITE, want)
  redis.call('PEXPIRE', K_SITESTATS, want)
  redis.call('ZADD', K_SITEIDX, now + want, site)
  -- the index lives as long as its latest site: once every site is idle, it is gone too
  if redis.call('PTTL', K_SITEIDX) < want then redis.call('PEXPIRE', K_SITEIDX, want) end
  -- Forget index entries of sites that expired (their keys are gone already).
  local gone = redis.call('ZRANGEBYSCORE', K_SITEIDX, '-inf', now, 'LIMIT', 0, 8)
  if #gone > 0 then redis.call('ZREM', K_SITEIDX, unpack(gone)) end
end

-- Make sure the site exists and learn one page of proxies it has not seen (called again for one
-- more page when nothing learnt so far is free); `pool_seq` is the pool's add number (P:meta seq,
-- read by pool_layout). Returns the site's
-- slots per proxy, whether it has seen every proxy and when its keys expire (see touch_site; nil when
-- not known). A site whose cursor is ahead of the pool (the pool was lost and restored while the
-- site's state survived) starts learning again.
local GOLDEN = 0.6180339887  -- the n-th site's phase: frac(n x GOLDEN), far from every earlier one's

local function ensure_site(site, concurrency, now, pool_seq, spread)
  local h = redis.call('HMGET', K_SITE, 'c', 'seq', 'x', 'ph')
  local c, seq = tonumber(h[1]), tonumber(h[2]) or 0
  local ph = tonumber(h[4])
  spread = spread or 0
  if spread > 0 and seq < pool_seq and not ph then
    -- The n-th live site's phase (K_SITEIDX: this one is indexed at its first lease's touch_site,
    -- after this).
    ph = (redis.call('ZCARD', K_SITEIDX) * GOLDEN) % 1
    redis.call('HSET', K_SITE, 'ph', tostring(ph))
  end
  -- the deadline holds only for keys this call does not create: none when learn() may add to (and so
  -- recreate) the ready set
  local deadline = tonumber(h[3])
  if seq ~= pool_seq then deadline = nil end
  if not c then
    c = concurrency
    redis.call('HSET', K_SITE, 'c', c, 'seq', 0)
    seq = 0
  elseif seq > pool_seq then
    seq = 0
  end
  return c, learn(site, c, seq, pool_seq, now, spread, ph or 0), deadline
end

-- Push every slot of a proxy on the call's site to at least `until_ms` (XX: never re-adds a removed
-- proxy; GT: never shortens a longer hold).
local function hold_slots(id, until_ms)
  local c = redis.call('HGET', K_SITE, 'c')
  if not c then return end
  for k = 0, tonumber(c) - 1 do
    redis.call('ZADD', K_READY, 'XX', 'GT', until_ms, id .. '/' .. k)
  end
end

-- lease.lua and hold.lua first: a pool written by an older version (P:meta without layout=3) is
-- migrated by PoolStore.migrate (paged, keys declared) before it is used. A pool without P:meta (new,
-- or lost by Redis) has nothing to migrate, and nothing is written (add.lua's restore keys on it).
-- Returns whether the pool needs migrating, and its add number (P:meta seq; one read for both).
local function pool_layout()
  local m = redis.call('HMGET', K_META, 'layout', 'seq')
  if m[1] == '3' then return false, tonumber(m[2]) or 0 end
  return m[2] ~= false or redis.call('EXISTS', K_META) == 1, tonumber(m[2]) or 0
end

-- P:bans and P:banidx live as long as their latest entry (the highest forget time in the index), no
-- longer: once every quarantine and strike window of a crawl has passed, nothing of them stays (an
-- entry's own removal, forget_old_bans below, needs later bans to run). Every writer of an entry calls
-- it after writing (`bans`, `idx`: those two keys, as the caller declares them).
local function bans_expire(bans, idx, now)
  local last = redis.call('ZRANGE', idx, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  local want = math.floor(tonumber(last[2]) - now) + 1000
  if want < 1000 then want = 1000 end
  -- each key on its own (one may have been deleted and written again since); no expiry yet (-1) too
  if redis.call('PTTL', idx) < want then redis.call('PEXPIRE', idx, want) end
  if redis.call('PTTL', bans) < want then redis.call('PEXPIRE', bans, want) end
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
-- ban) does not add a strike. `fresh`: start again from the first strike (an adaptive-pacing rate ban
-- of a proxy whose previous answer on the site was clean: the pace, not the IP, was at fault). `flat`:
-- the TTL is base_ms whatever the strikes (the caller escalated it). Returns until_ms, strikes, and 1 if
-- this call started the quarantine.
local function ban(scope, id, reason, base_ms, max_ms, jitter, window_ms, now, fresh, told_ms, flat)
  local field = scope .. '|' .. id
  local prev = redis.call('HGET', K_BANS, field)
  local strikes = 0
  local wrong = false  -- banned again within one quarantine length of its return
  if prev then
    local p_until, p_strikes, p_since = string.match(prev, '^(%d+)|(%d+)|[^|]*|(%d+)')
    p_until = tonumber(p_until)
    p_strikes = tonumber(p_strikes)
    if p_until > now then return p_until, p_strikes, 0 end
    if now - p_until < window_ms and not fresh then strikes = p_strikes end
    p_since = tonumber(p_since)
    wrong = p_since ~= nil and now - p_until < p_until - p_since
  end
  strikes = strikes + 1
  local ttl
  if told_ms and told_ms > 0 and not wrong then
    -- the site's Retry-After: exactly that long (the caller caps it), unless its word proved wrong
    ttl = told_ms
  else
    ttl = base_ms
    if not flat then ttl = base_ms * math.pow(2, strikes - 1) end
    if ttl > max_ms then ttl = max_ms end
    ttl = math.floor(ttl * (1 + jitter))
    if ttl < 1 then ttl = 1 end
    -- banned again right after the site's Retry-After: its word is too short, never too long (the
    -- new ban is the site's to time: a rule the pace broke again, or a longer ban than it said)
    if told_ms and told_ms > ttl then ttl = told_ms end
  end
  local until_ms = now + ttl
  redis.call('HSET', K_BANS, field, istr(until_ms) .. '|' .. strikes .. '|' .. reason .. '|' .. istr(now))
  redis.call('ZADD', K_BANIDX, until_ms + window_ms, field)
  redis.call('HINCRBY', K_COUNTERS, 'q_started', 1)
  redis.call('HINCRBY', K_COUNTERS, 'q_ms', ttl)
  -- A proxy-wide quarantine is not pushed into every site (that would cost sites x slots): each
  -- lease checks the proxy it picks (see lease.lua) and defers it there.
  if scope ~= '*' then hold_slots(id, until_ms) end
  redis.call('HINCRBY', K_PSTATS, id .. ':ban', 1)
  if scope == '*' then  -- proxy-wide: the pool's hash (its fields: one per reason, a bounded set)
    redis.call('HINCRBY', K_SSTATS, scope .. ':ban', 1)
    redis.call('HINCRBY', K_SSTATS, scope .. ':ban:' .. reason, 1)
  else
    site_stat('ban')
    site_stat('ban:' .. reason)
  end
  forget_old_bans(now)
  bans_expire(K_BANS, K_BANIDX, now)
  return until_ms, strikes, 1
end

-- An overlap floor: hold.lua found a slot held in Redis by one lease while another host's local
-- fallback lease of it was in flight (the overlap happened during the outage). Nobody else may be
-- handed the slot before that local lease ends, even when the Redis holder gives it back sooner:
-- hold.lua keeps the end (ms) in the site's hash beside the held record, under this field, and each
-- script that frees a held slot readies it no sooner and drops the field with the record.
local function floor_field(member)
  return member .. '^'
end
-- `at` (ms), or the overlap floor `floor` (the field's value as read, false or nil for none) if later.
local function not_before_floor(at, floor)
  floor = tonumber(floor)
  if floor and floor > at then return floor end
  return at
end

-- The overlapping local leases a floor stands for: {token = end_ms} of those not ended by now, kept
-- under floor_field(member) .. 'o' as "token=end,token=end" (hold.lua adds, lift.lua removes).
local function overlap_ends(member, now)
  local ends = {}
  for token, at in string.gmatch(redis.call('HGET', K_SITE, floor_field(member) .. 'o') or '', '([^=,]+)=(%d+)') do
    if tonumber(at) > now then ends[token] = tonumber(at) end
  end
  return ends
end
local function set_overlap_ends(member, ends)
  local parts = {}
  for token, at in pairs(ends) do parts[#parts + 1] = token .. '=' .. string.format('%d', at) end
  if #parts > 0 then
    redis.call('HSET', K_SITE, floor_field(member) .. 'o', table.concat(parts, ','))
  else
    redis.call('HDEL', K_SITE, floor_field(member) .. 'o')
  end
end

-- Drop a slot's held record and its overlap floor; returns `at`, or the floor if later: when the
-- freed slot may be handed out. For the rare paths (release.lua reads both fields with its one
-- record read instead).
local function drop_held(member, at)
  local floor = redis.call('HGET', K_SITE, floor_field(member))
  redis.call('HDEL', K_SITE, member, floor_field(member))
  return not_before_floor(at, floor)
end

-- The ms from which a slot of a proxy being (re-)added may be used: not before a quarantine ends,
-- nor before a lease or sticky session that still holds the slot (its held record) runs out, nor
-- before its overlap floor. A proxy removed and added again while a request holds it must not be
-- handed out twice.
local function slot_free_at(site, id, member, now)
  local at = blocked_until(site, id)
  if at < now then at = now end
  local rec = redis.call('HMGET', K_SITE, member, floor_field(member))
  local held = held_until(rec[1])
  if held > at then at = held end
  return not_before_floor(at, rec[2])
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

-- Host records (host_beat.lua, host_leave.lua, hosts.lua; see health.py) are fields of K_HOSTINFO
-- and K_LOAD: forgetting a host is an HDEL on declared keys.
local function forget_host(host)
  redis.call('HDEL', K_HOSTINFO, host)
  redis.call('HDEL', K_LOAD, host)
end

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

-- ==== site circuit breaker (engine/breaker.py; used by lease.lua and release.lua only) ====
-- A site that rejects everyone would burn proxy after proxy: once enough quarantines on one site,
-- from enough distinct proxies, came within a window with no successful response in between, the
-- site's breaker opens: no lease for the site on any host until the cool-off ends; then half-open:
-- one probe lease at a time (at most `probes` per round); a probe answered "ok" closes it, one banned
-- (or a round of probes without a verdict) re-opens it for twice the cool-off, capped. While open or
-- half-open a ban on the site quarantines nobody (no strike: the site is the problem, not the IP).
--   P:breaker:<site>  HASH  st=open|half until=ms (open: probing from then) cool=ms (current cool-off)
--                           maxc=ms probes=n used=n (probes this round) ptok=probe lease token
--                           pexp=ms (probe lease expiry) since=ms trips=n base=ms (the cool-off a
--                           burst's opening cut short, see breaker_evidence); no key = closed
--   P:brkseen:<site>  ZSET  quarantines started on the site since its last "ok" response, within the
--                           window: member "<id>|<reason>|<ms>|<retry-after ms>|<request start ms>" -> ms
--                           (at most BREAKER_SEEN_MAX kept)
local BREAKER_SEEN_MAX = 64
local BREAKER_KEEP_MS = 86400000  -- a breaker nobody touches for a day after its cool-off is forgotten
local BREAKER_BURST_MS = 1000  -- the first cool-off of a breaker opened by one burst (breaker_evidence)

-- The packed options of release.lua's breaker argument ("" = breaker off): threshold, min distinct
-- proxies, window ms, cool-off ms, max cool-off ms, probes per round. Returns the options (nil when
-- off) and an error message for a malformed argument (checked before any write).
local function breaker_conf(raw)
  if raw == nil or raw == '' then return nil, nil end
  local v = {}
  for part in string.gmatch(raw, '[^,]+') do v[#v + 1] = tonumber(part) end
  local ok = #v == 6
  for i = 1, #v do
    if not ok or v[i] == nil or v[i] ~= math.floor(v[i]) or v[i] < 1 or v[i] > MAX_MS then ok = false end
  end
  if not ok or v[5] < v[4] then
    return nil, 'ERR scrapy-proxy-shard: argument breaker (' .. raw .. ') must be "threshold,min_proxies,'
      .. 'window_ms,cooloff_ms,max_cooloff_ms,probes" (whole numbers from 1, max_cooloff >= cooloff)'
  end
  return {threshold = v[1], min_proxies = v[2], window = v[3], cool = v[4], maxc = v[5], probes = v[6]}, nil
end

-- Wake every waiter of the site (up to the freed list's 8 entries): the breaker closed.
local function announce_all()
  if redis.call('EXISTS', K_WAITING) == 0 then return end
  redis.call('LPUSH', K_FREED, '1', '1', '1', '1', '1', '1', '1', '1')
  redis.call('LTRIM', K_FREED, 0, 7)
  redis.call('PEXPIRE', K_FREED, 60000)
end

-- Open (again) for `cool` ms from now. Returns the cool-off.
local function breaker_open_for(cool, now)
  redis.call('HSET', K_BREAKER, 'st', 'open', 'until', istr(now + cool), 'cool', istr(cool), 'used', 0,
    'ptok', '', 'pexp', 0)
  redis.call('HINCRBY', K_BREAKER, 'trips', 1)
  redis.call('PEXPIRE', K_BREAKER, cool + BREAKER_KEEP_MS)
  return cool
end

-- A probe was rejected, or a round of probes ended without a verdict: re-open for twice as long (for the
-- cool-off a burst's opening cut short, 'base', the first time).
local function breaker_reopen(site, now)
  local b = redis.call('HMGET', K_BREAKER, 'cool', 'maxc', 'base')
  local cool = (tonumber(b[1]) or 1) * 2
  local maxc = tonumber(b[2]) or cool
  if b[3] then
    cool = tonumber(b[3]) or cool
    redis.call('HDEL', K_BREAKER, 'base')
  end
  if cool > maxc then cool = maxc end
  site_stat('brk_reopen')
  return breaker_open_for(cool, now)
end

-- lease.lua, before anything else: a WAIT reply when the site's breaker refuses a lease now (reason
-- "breaker"; open: the time until probing starts; half-open: until the probe in flight expires, a
-- release may come sooner), else nil. The second value is true when the lease about to be made is a
-- probe (half-open): call breaker_probe_taken once it is made.
local function breaker_gate(site, now)
  local b = redis.call('HMGET', K_BREAKER, 'st', 'until', 'used', 'probes', 'ptok', 'pexp')
  if not b[1] then return nil, false end
  local wait = nil
  local firm = true  -- open: no release ends it before probing starts (see lease.lua's firm WAIT)
  if b[1] == 'open' then
    local until_ms = tonumber(b[2]) or 0
    if now < until_ms then
      wait = until_ms - now
    else
      redis.call('HSET', K_BREAKER, 'st', 'half', 'used', 0, 'ptok', '', 'pexp', 0)
      b[3], b[5] = '0', ''
    end
  end
  if not wait and b[5] ~= '' and (tonumber(b[6]) or 0) > now then
    wait = tonumber(b[6]) - now  -- one probe at a time
    firm = false  -- its release may come sooner
  end
  if not wait and (tonumber(b[3]) or 0) >= (tonumber(b[4]) or 1) then
    wait = breaker_reopen(site, now)  -- a round of probes came back without a verdict
  end
  if wait then
    redis.call('SET', K_WAITING, '1', 'PX', 6000)
    if firm then return {'WAIT', math.max(1, wait), 'breaker', 1}, false end
    return {'WAIT', math.max(1, wait), 'breaker'}, false
  end
  return nil, true
end

-- lease.lua: the lease `token` (in flight until `expires_ms`) is the half-open breaker's probe.
local function breaker_probe_taken(token, expires_ms)
  redis.call('HSET', K_BREAKER, 'ptok', token, 'pexp', istr(expires_ms))
  redis.call('HINCRBY', K_BREAKER, 'used', 1)
end

-- release.lua, before the outcome is recorded, when the breaker is on for this host and the site's
-- breaker is open or half-open (`b`: its st and ptok fields; release.lua itself handles a closed one:
-- an "ok" forgets the quarantines seen so far, the site does not reject everyone). Returns whether a
-- ban on the site is to be spared (no quarantine, no strike; counted here) and the event of this
-- release, if any: {"closed", ...} (the probe was answered fine), {"reopened", 0, 0, "", 0, cool_ms}
-- (the probe was banned) or {"spared", ...} (any other ban while open or half-open).
local function breaker_on_release(site, token, outcome, now, b)
  if b[2] == token then
    if outcome == 'ok' then
      redis.call('DEL', K_BREAKER, K_BRKSEEN)
      site_stat('brk_close')
      announce_all()
      return false, {'closed', 0, 0, '', 0, 0}
    elseif outcome == 'ban' then
      site_stat('brk_spared')
      return true, {'reopened', 0, 0, '', 0, breaker_reopen(site, now)}
    end
    redis.call('HSET', K_BREAKER, 'ptok', '', 'pexp', 0)  -- no verdict (error, 404...): the next lease probes
  end
  if outcome ~= 'ban' then return true, nil end
  site_stat('brk_spared')
  return true, {'spared', 0, 0, '', 0, 0}
end

-- release.lua, after a ban on the site started a quarantine while the breaker is closed: remember it,
-- and open the breaker if the evidence is now enough. `told`: the site's Retry-After of the ban (ms, 0:
-- none); when every ban of the evidence carried one, the cool-off is the longest of them if that is
-- shorter than the configured one (the site said when it takes the IPs back: probing later wastes the
-- time between). `start`: the banned request's start (ms; nil when unknown). Evidence that is one
-- burst (every request of it sent before the first of them was answered: a crawl's stalled requests
-- arriving at once, say, all rejected for being early) says nothing of the requests sent after it:
-- the breaker opens, sparing the rest of the burst, but probes after BREAKER_BURST_MS; only a probe
-- rejected too (a site that rejects everyone rejects fresh requests) opens it for the cool-off, whose
-- doubling then goes on as usual ('base'). Returns {"opened", bans, distinct proxies, "reason:n,...",
-- window_ms, cool_ms} when this call opened it, else nil.
local function breaker_evidence(site, id, reason, now, conf, told, start)
  redis.call('ZADD', K_BRKSEEN, now, id .. '|' .. reason .. '|' .. istr(now) .. '|' .. istr(told or 0) .. '|'
    .. istr(start or 0))
  redis.call('ZREMRANGEBYSCORE', K_BRKSEEN, '-inf', '(' .. istr(now - conf.window))
  redis.call('ZREMRANGEBYRANK', K_BRKSEEN, 0, -(BREAKER_SEEN_MAX + 1))
  redis.call('PEXPIRE', K_BRKSEEN, conf.window)
  local seen = redis.call('ZRANGE', K_BRKSEEN, 0, -1)
  if #seen < conf.threshold then return nil end
  local proxies, distinct, reasons, order = {}, 0, {}, {}
  local told_max = 0  -- the longest Retry-After of the evidence; -1 once a ban came without one
  local first, latest = nil, 0  -- the first answer of the evidence; the latest request start
  for _, m in ipairs(seen) do
    local pid, why, at, said, sent = string.match(m, '^(.*)|([^|]*)|(%d+)|(%d+)|(%d+)$')
    if not pid then pid, why, at, said = string.match(m, '^(.*)|([^|]*)|(%d+)|(%d+)$') end  -- (before 12-08)
    at, sent = tonumber(at), tonumber(sent) or 0
    if at and (not first or at < first) then first = at end
    if sent > latest then latest = sent end
    said = tonumber(said) or 0
    if said <= 0 then told_max = -1 elseif told_max >= 0 and said > told_max then told_max = said end
    if pid and not proxies[pid] then
      proxies[pid] = true
      distinct = distinct + 1
    end
    if why then
      if not reasons[why] then order[#order + 1] = why end
      reasons[why] = (reasons[why] or 0) + 1
    end
  end
  if distinct < conf.min_proxies then return nil end
  local parts = {}
  for _, why in ipairs(order) do parts[#parts + 1] = why .. ':' .. reasons[why] end
  local cool = conf.cool
  if told_max > 0 and told_max < cool then cool = told_max end
  redis.call('DEL', K_BREAKER, K_BRKSEEN)
  redis.call('HSET', K_BREAKER, 'maxc', istr(conf.maxc), 'probes', conf.probes, 'since', istr(now), 'trips', 0)
  if first and latest < first and cool > BREAKER_BURST_MS then
    redis.call('HSET', K_BREAKER, 'base', istr(cool))
    cool = BREAKER_BURST_MS
  end
  breaker_open_for(cool, now)
  site_stat('brk_open')
  return {'opened', #seen, distinct, table.concat(parts, ','), conf.window, cool}
end
