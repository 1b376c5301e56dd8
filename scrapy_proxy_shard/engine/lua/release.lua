-- release.lua: end one use of a leased slot, record its outcome, and quarantine the proxy if banned.
-- KEYS: lease_memo proxies bans banidx pstats hstats sstats sitestats counters siteidx site ready waiting freed session breaker brkseen pace gwbusy gwrot
--        (gwbusy: a gateway slot's request in flight, see lease.lua: this release's record is removed;
--        gwrot: the gateway's rotations per site, see gateway_rotate.lua: a clean answer ends the run)
--        (roles in order, see engine/keyset.py: lease_memo = P:done:lease:<token>, the lease's memo,
--        which this release's reply overwrites (see remember_release in _lib.lua); per-site keys of ARGV[1],
--        session = P:session:<site>:<ARGV[8]>)
-- ARGV[1]  site
-- ARGV[2]  member "<id>/<k>" from the lease reply
-- ARGV[3]  token from the lease reply
-- ARGV[4]  outcome: "ok" | "error" | "ban" | "dead" | "unknown"
--          ("ban": quarantine on the site; "dead": proxy-wide quarantine, e.g. connection refused;
--          "unknown": neither success nor failure, e.g. a 404: counted as a lease only)
-- ARGV[5]  latency, ms (integer; -1 when unknown); feeds the proxy's EWMA latency on "ok"
-- ARGV[6]  pacing interval, ms: the slot's next use on this site starts at least this long after
--          the START of this use (start-to-start, the held record's issued_ms on the Redis clock);
--          already randomized by the caller when PROXY_SHARD_RANDOMIZE_INTERVAL is on
-- ARGV[7]  host id of the caller
-- ARGV[8]  session id, or ""
-- ARGV[9]  session TTL, ms (sliding)
-- ARGV[10] ban reason (letters, digits, '_', '-', ':'), with "ban"/"dead"
-- ARGV[11] ban base TTL, ms        ARGV[12] ban max TTL, ms
-- ARGV[13] jitter as a fraction to add to the TTL (e.g. "-0.07"), chosen by the caller
-- ARGV[14] strike window, ms: a ban within this long after the previous one ended escalates
-- ARGV[15] EWMA weight of the new latency sample (e.g. "0.2")
-- ARGV[16] rest after the response, ms: the slot's next use starts at least this long after now
--          (the slot is free at max(start + ARGV[6], now + ARGV[16]), never before a quarantine ends)
-- ARGV[17] the site's circuit breaker options, "threshold,min_proxies,window_ms,cooloff_ms,
--          max_cooloff_ms,probes", or "" when the breaker is off (see breaker_conf in _lib.lua)
-- ARGV[18] site idle TTL, ms: a sticky session's slot stays held session TTL from now, and the
--          site's state (its held records) lives at least this long after that
-- ARGV[19] adaptive pacing: "1" on (the site's learned interval in P:pace:<site> replaces ARGV[6];
--          see pace_release in _pace.lua), "0" off (ARGV[20..24] are then ignored)
-- ARGV[20] learned interval to start from, ms    ARGV[21] its minimum, ms    ARGV[22] its maximum, ms
-- ARGV[23] factor the learned interval is paced with (the caller's randomization draw; "1" for none)
-- ARGV[24] the ban's kind: 0 none (not a ban), 1 rate-type (PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS, or a
--          Retry-After), 2 a block (403...), 3 a failed content check (missing CSS, a small body)
-- ARGV[25] the shortest brief quarantine, ms (AUTOTHROTTLE_BAN_TTL): the site's learned rest never
--          goes below it (see site_learn)
--          In every mode this answer first teaches the site's state (site_learn in _pace.lua): the
--          proxy's mark, the site's rest and, with a fixed interval, the path margin added to ARGV[6]
-- ARGV[26] the site's Retry-After of this ban, ms, or 0: the quarantine lasts exactly that long (no
--          jitter, no learned rest) unless the IP was banned again within one quarantine length of
--          its return (the site's word proved wrong: the usual escalation from ARGV[11])
-- ARGV[27] arrival guard cap, ms (0: none)    ARGV[28] the caller's floor for this proxy on the site, ms
--          (-1: none yet: paced from this release whatever the cap). The slot's next start is pushed back by min(cap, max(1, now - start - floor)):
--          it is paced from when this request can have reached the site, not from its lease (a request
--          slower than the quickest the caller has seen can have arrived that much late; see
--          crawl/arrival.py). Without a floor (the caller's first use of the proxy on the site: new
--          connections) by now - start: this release is the only sure bound on the arrival
-- ARGV[30] the gateway id of a gateway slot (engine/gateway.py; "gw" for a slot marked #session=gw.
--          whose id does not parse), or "": only then is the slot's record in gwbusy removed, and an
--          "ok" through it forgets the gateway's rotations on the site (a fresh IP worked there)
-- ARGV[31] adaptive pacing: "1" a site whose answers outlast its interval may be tried with two
--          requests in flight per IP (conc_release in _pace.lua), "0" never (one per IP)
-- ARGV[29] (optional) the path margin a fixed interval starts with, as a share of it (at most 20 ms)
--          until the site teaches one (see site_learn); 0 or absent: none
-- Replies:
--   {"OK", now_ms, ban_until_ms, strikes, breaker_event, bans, proxies, reasons, window_ms, cooloff_ms,
--    learned_interval, pace_event, margin_ms, margin_event, free_at_ms}
--        released (ban fields 0 when no ban was applied). breaker_event "" or: "opened" (this ban
--        opened the site's breaker: bans, distinct proxies, "reason:n,..." and window are the
--        evidence), "reopened" (this probe was banned), "closed" (this probe was fine), "spared" (a
--        ban while the breaker is open or half-open: no quarantine, no strike); cooloff_ms with
--        opened/reopened. learned_interval: the site's learned interval in force, ms as a string, ""
--        when ARGV[18] is "0"; pace_event: what this answer did to it: "", "probe", "down", "fail",
--        "back", "up", "skip" or "forget". margin_ms: the site's path margin in force (ms, fixed
--        interval only, "0" otherwise); margin_event "" or "widen"; free_at_ms: when the slot given
--        back may be used again (its ready score; 0 for a session's slot or a release that freed
--        nothing): a host wakes a request sleeping longer than that (crawl/pacewake.py). The STALE
--        and EXPIRED replies carry the same fields.
--   {"STALE", now_ms, ban_until_ms, strikes}   the lease had expired and someone else holds the slot
--        now: nothing was freed (never a double use); outcome and ban are still recorded
--   {"EXPIRED", now_ms, ban_until_ms, strikes} the lease had expired and nobody holds the slot;
--        nothing to free; outcome and ban are recorded

-- A repeated call with the same token (a client retry) answers the first reply again without
-- recording the outcome twice. The arguments are trusted, as lease.lua's (checked by the store before
-- the call: 26 checks here cost ~5 us of Redis time per release); the packed breaker options and the
-- member are parsed here anyway, and refused with an error reply before any write.
local breaker, bad_breaker = breaker_conf(ARGV[17])
if bad_breaker then return redis.error_reply(bad_breaker) end
if not id_of(ARGV[2]) then return redis.error_reply('ERR scrapy-proxy-shard: argument member must be <id>/<slot>') end
local site, member, token, outcome = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
-- The slot's held record and its overlap floor (see floor_field), the site's slots per proxy, and with
-- more than one the proxy's latest start and the spacing leases keep between its slots (see ip_field),
-- read once.
local held_now = redis.call('HMGET', K_SITE, member, floor_field(member), 'c', ip_field(id_of(ARGV[2]) or ''),
  IP_SPACING, 'ht')
local record = held_now[1]
local now, now_str = now_ms()
site_as_table(held_now[6], now)
-- A plain release whose record is still live and its own has not run before (a first run would have
-- deleted it, and only the lease with this token writes one): only the others look for a memo.
if ARGV[8] ~= '' or not held_with(live_record(record, now), token) then
  local v = redis.call('GET', K_LEASE_MEMO)
  local earlier = v and release_memo_reply(v)
  if earlier then return earlier end
end

if ARGV[30] ~= '' then  -- a gateway slot: its record of a request in flight goes (see gw_take)
  local gw = redis.call('HGET', K_GWBUSY, id_of(member))
  if gw and string.sub(gw, 1, #token + 1) == token .. '|' then redis.call('HDEL', K_GWBUSY, id_of(member)) end
end

local latency = tonumber(ARGV[5])
local interval = tonumber(ARGV[6])
-- What leases keep between one proxy's slots on the site (IP_SPACING, several slots per proxy): the
-- site's interval in force, never a probe's (this proxy's own `interval` may be a probe's lower one).
local spacing = interval
local rest = tonumber(ARGV[16])
local host, sid = ARGV[7], ARGV[8]
local session_ttl = tonumber(ARGV[9])
local id = id_of(member)
local ready = K_READY
local status = 'OK'
local free_at = 0  -- when the given-back slot may be used again (ms; 0: not a plain slot given back)

-- What the site teaches in every mode (the proxy's last answer, the site's rest, the path margin),
-- then adaptive pacing: this answer updates the site's learned interval, which then paces the slot.
local kind = tonumber(ARGV[24])
local answer_start = nil  -- the answered request's start (ms), when its lease is still this one
if held_with(record, token) then answer_start = lease_start(record) end
local adaptive = ARGV[19] == '1'
local fixed = interval
if adaptive then fixed = 0 end
-- What the site taught lives as long as its state (a sticky session's slot is held a session TTL
-- longer), or a week when adaptive pacing learned an interval (below); the pace hash is read once.
local learn_keep = tonumber(ARGV[18])
if ARGV[8] ~= '' then learn_keep = learn_keep + tonumber(ARGV[9]) end
local taught
if adaptive then
  taught = redis.call('HMGET', K_PACE, 'p:' .. id, 'rest', 'mg', 'mgs', 'mge', 'mgr', 'mgb', 'xp',
    'iv', 'eff', 'run', 'bad', 'vote', 'probe', 'piv', 'pat', 'pn', 'prev', 'pend', 'firm', 'pls', 'born', 'pfc', 'pfi',
    'cc', 'bz', 'ccp', 'cct', 'ccn', 'cce', 'ht')
else
  taught = redis.call('HMGET', K_PACE, 'p:' .. id, 'rest', 'mg', 'mgs', 'mge', 'mgr', 'mgb', 'xp', 'ht')
end
-- (the pace hash's ht: already in the hashtable encoding, see pace_as_table)
local pace_ht = taught[adaptive and 31 or 9] == '1'
local last_answer, site_rest, margin, margin_event, pace_wrote, rest_lo, rest_hi
last_answer, site_rest, margin, margin_event, pace_wrote, pace_ht, rest_lo, rest_hi = site_learn(site, id,
  answer_start, outcome, kind, tonumber(ARGV[25]), fixed, tonumber(ARGV[29]) or 0, now, taught, pace_ht)
local pace_iv, pace_event = '', ''
if adaptive then
  --@lazy pace_release conc_release
  -- a vote against the pace: a rate-type ban, or a block right after a clean answer; not a ban of the
  -- proxy trying two slots, to a request started while it did (conc_release: it tests overlap, not the
  -- pace; cce: when a ban ended that)
  local rate = kind == 1 or (kind >= 2 and last_answer == 'c')
  if taught[27] == id and answer_start and answer_start >= (tonumber(taught[28]) or 0)
      and answer_start < (tonumber(taught[30]) or math.huge) then
    rate = false
  end
  local paced, learned
  local kept, two
  local slots = tonumber(held_now[3]) or 1
  local pace_slots = slots  -- (one while a proxy tries two: the others' probes test one slot's gaps)
  if taught[27] and taught[27] ~= '' and taught[25] ~= '1' then pace_slots = 1 end
  -- (two in flight per IP may be asked for: allowed by the caller, no verdict cc yet, nobody trying)
  local allow_two = ARGV[31] == '1'
  local may_two = allow_two and (taught[25] or '') == '' and (taught[27] or '') == ''
  paced, pace_event, learned, kept, two = pace_release(site, id, answer_start, outcome, rate,
    tonumber(ARGV[20]), tonumber(ARGV[21]), tonumber(ARGV[22]), last_answer, now, taught, 8, tonumber(ARGV[23]) == 1,
    pace_slots, may_two)
  local born = tonumber(taught[22])
  local conc_event = conc_release(id, member, answer_start, outcome, learned, slots, now, taught, 24, two,
    taught[14] ~= id and pace_event ~= 'probe', tonumber(taught[23]) or PACE_COST_PRIOR, born and now - born,
    allow_two)
  if pace_event == '' then pace_event = conc_event end
  interval = math.floor(paced * tonumber(ARGV[23]) + 0.5)
  spacing = math.floor(learned * tonumber(ARGV[23]) + 0.5)
  if spacing < interval then spacing = interval end
  pace_iv = pace_ms(learned)
  -- a learned pace outlives restarts, not a dead site; one that learned nothing goes with the site
  if kept then learn_keep = PACE_KEEP_MS end
  pace_wrote = true  -- (pace_release keeps the hash's interval: it exists now)
elseif interval > 0 then
  interval = interval + math.floor(margin + 0.5)
  spacing = interval
end
-- The interval a use that started at `start` paces its slot with: + the arrival guard's shift.
local guard_cap, guard_floor = tonumber(ARGV[27]), tonumber(ARGV[28])
local function guarded(start)
  if not start then return interval end
  if guard_floor < 0 then return interval + now - start end  -- no floor (cold): paced from this release
  if guard_cap == 0 then return interval end
  local shift = now - start - guard_floor
  -- At least 1 ms: `start` is whole ms, read up to 1 ms before the true start.
  if shift < 1 then shift = 1 elseif shift > guard_cap then shift = guard_cap end
  return interval + shift
end

if sid ~= '' then
  local S = K_SESSION
  local s = redis.call('HMGET', S, 't', 'm')
  if not s[1] or s[2] ~= member then
    status = 'EXPIRED'
  elseif s[1] ~= token then
    status = 'STALE'
  else
    --@lazy held_record touch_site
    -- The session's next use follows the same pacing law as a plain slot.
    local start = lease_start(record)
    redis.call('HSET', S, 'busy', 0, 'next', paced_at(start, guarded(start), now, rest))
    redis.call('PEXPIRE', S, session_ttl)
    redis.call('HSET', K_SITE, member, held_record(token, host, start or now, now + session_ttl, sid))
    local b = blocked_until(site, id)
    local hold = now + session_ttl
    if b > hold then hold = b end
    hold = not_before_floor(hold, held_now[2])  -- the session stays bound, but may lapse before it
    redis.call('ZADD', ready, 'XX', hold, member)
    touch_site(site, now + session_ttl, tonumber(ARGV[18]), now)
  end
else
  local v = live_record(record, now)
  if not v then
    status = 'EXPIRED'
  elseif not held_with(v, token) then
    status = 'STALE'
  else
    redis.call('HDEL', K_SITE, member, floor_field(member))
    local start = lease_start(v)
    local paced = guarded(start)
    local at = paced_at(start, paced, now, rest)
    local c = tonumber(held_now[3]) or 1
    if c > 1 then
      -- Several slots per proxy: the interval is the IP's, not the slot's (the site counts arrivals
      -- per IP): not before the proxy's latest start + the interval, and leases keep its other slots
      -- that far apart (lease.lua reads the spacing from here).
      local latest = tonumber(held_now[4])
      -- This use may have reached the site as late as `reach` (the guard's shift; a cold pair: now, its
      -- new connection's way out unknown): when no other slot of the IP started since, its slots not in
      -- use wait the spacing after that, not after the lease. Else a late first use and the IP's next
      -- lease, timed from the first's start, reach the site closer than the interval.
      local reach = start and start + paced - interval
      if reach and reach > start + 1 and (not latest or latest <= start) then
        latest = reach
        space_ip_slots(id, member, c, reach, spacing)
      end
      if latest and latest + interval > at then at = latest + interval end
      if tostring(spacing) ~= held_now[5] then redis.call('HSET', K_SITE, IP_SPACING, tostring(spacing)) end
    end
    at = not_before_floor(next_free(site, id, at), held_now[2])
    free_at = at
    if redis.call('ZADD', ready, 'XX', 'CH', at, member) == 1 then
      announce_freed()
    end
  end
end

if status ~= 'OK' then
  redis.call('HINCRBY', K_COUNTERS, string.lower(status), 1)
  redis.call('HINCRBY', K_HSTATS, host .. ':' .. string.lower(status), 1)
end

local ban_until, strikes = 0, 0
local spare, event = false, nil
if breaker then  -- on for this host (the breaker helpers are defined only when the site's is open)
  local b = redis.call('HMGET', K_BREAKER, 'st', 'ptok')
  if b[1] then
    --@lazy breaker_on_release
    spare, event = breaker_on_release(site, token, outcome, now, b)
  elseif outcome == 'ok' then
    redis.call('DEL', K_BRKSEEN)  -- closed: a fine answer forgets the quarantines seen so far
  end
end
if outcome == 'ok' then
  if ARGV[30] and ARGV[30] ~= '' then redis.call('HDEL', K_GWROT, ARGV[30] .. '|' .. site) end
  redis.call('HINCRBY', K_HSTATS, host .. ':ok', 1)
  redis.call('HINCRBY', K_SITESTATS, 'ok', 1)
  if latency >= 0 then  -- the proxy's count and EWMA latency: one read, one write
    local alpha = tonumber(ARGV[15])
    local p = redis.call('HMGET', K_PSTATS, id .. ':ok', id .. ':lat')
    local old = tonumber(p[2])
    local ewma = latency
    if old then ewma = old + alpha * (latency - old) end
    redis.call('HSET', K_PSTATS, id .. ':ok', istr((tonumber(p[1]) or 0) + 1), id .. ':lat', string.format('%.3f', ewma))
  else
    redis.call('HINCRBY', K_PSTATS, id .. ':ok', 1)
  end
elseif outcome == 'ban' or outcome == 'dead' then
  --@lazy ban breaker_evidence
  local scope = site
  if outcome == 'dead' then scope = '*' end
  -- responses judged a ban are ':banned' on every scope (':ban' counts quarantines started: see ban())
  redis.call('HINCRBY', K_HSTATS, host .. ':banned', 1)
  redis.call('HINCRBY', K_SITESTATS, 'banned', 1)
  local started = 0
  local told = tonumber(ARGV[26])
  if not (outcome == 'ban' and spare) then  -- spared: the site's breaker is open or half-open
    -- Quarantine fit to the cause: a rate-type ban, or any ban of a proxy that answered clean or came
    -- back from a brief quarantine, is brief: from the site's rest (learned from when banned IPs come
    -- back clean), a new first strike after a clean answer, escalating on repeat. Banned again right
    -- after its rest, the IP's escalated length becomes the site's rest (if it answered clean before
    -- that series: see brief_of). A hard block (a first contact
    -- answered 403, or a ban after a block) keeps the ban TTL. The site's Retry-After wins over both.
    -- banned again right after a brief quarantine of this length, and whether it answered clean before
    local before, lineage, since = brief_of(last_answer)
    local brief = outcome == 'ban' and (kind == 1 or last_answer == 'c' or before ~= nil)
    local base = tonumber(ARGV[11])
    if brief then
      -- x 2 on repeat; x 4 for an IP that never answered clean on the site (likely blacklisted), and for a
      -- block (a 403 after clean answers: a site that blocks rather than says "slow down" blocks for
      -- longer, often minutes; each return too early is one more blocked answer). A block's first rest
      -- is that x 4 too while the site has taught no rest (its rest is still the shortest allowed).
      base = site_rest
      local grow = 2
      if not lineage or kind >= 2 then grow = 4 end
      if before and grow * before > base then base = grow * before end
      if not before and kind >= 2 and site_rest <= tonumber(ARGV[25]) then base = 4 * site_rest end
      -- An IP came back clean once rest_hi after its series began (rest_of): the site's bans end within
      -- that of their start, so a series goes no further, however it escalates (a site that starts its
      -- ban again at each refused request refuses that return too, and rest_hi goes).
      if before and lineage and since and rest_hi and rest_hi > now - since then
        local left = rest_hi - (now - since)
        if left < tonumber(ARGV[25]) then left = tonumber(ARGV[25]) end
        if base > left then base = left end
      end
    end
    ban_until, strikes, started = ban(scope, id, ARGV[10], base, tonumber(ARGV[12]),
      tonumber(ARGV[13]), tonumber(ARGV[14]), now, brief and last_answer == 'c', told, brief)
    if pace_event == 'fail' and ban_until > now then
      -- What a failed probe cost: its IP's quarantine on the site when the site said how long
      -- (Retry-After); else unknown until the IP answers clean there again (pace_release), assumed
      -- PACE_COST_PRIOR meanwhile. The next probes weigh it (next_probe).
      if told and told > 0 then
        redis.call('HSET', K_PACE, 'pfc', istr(ban_until - now), 'pfi', '')
      else
        redis.call('HSET', K_PACE, 'pfc', '', 'pfi', id .. '|' .. istr(now))
      end
    end
    if started == 1 and outcome == 'ban' then
      if brief and told == 0 and lineage then
        -- Refused again after resting `before`: the site's bans outlast that (rest_lo; a bound at or
        -- below it is void: the site's bans got longer), and its rest proved too short: the next series
        -- starts from what the bounds call for, or while no IP came back clean, from twice lo (this
        -- IP's series escalates x 4 to find the end; the next series need not start that far out).
        -- (lineage: the last mark was a brief quarantine's, so `before` is its length)
        local lo, hi, rest = rest_lo, rest_hi, site_rest
        if not lo or before > lo then lo = before end
        -- (refused as long after the series began: the bans outlast hi, or start again at each refusal)
        if hi and (hi <= before or (since and hi <= (answer_start or now) - since)) then hi = nil end
        local guess = rest_guess(lo, hi)
        if guess then rest = guess elseif lo and 2 * lo > rest then rest = 2 * lo end
        if rest ~= site_rest or lo ~= rest_lo or hi ~= rest_hi then
          redis.call('HSET', K_PACE, 'rest', rest_field(rest, lo, hi))
          pace_wrote = true
        end
      end
      site_mark(id, last_answer, brief and ban_until - now or nil, pace_ht, now)
      pace_wrote = true
    end
  end
  if outcome == 'ban' and started == 1 and breaker then
    event = breaker_evidence(site, id, ARGV[10], now, breaker, told, answer_start)
  end
  if ban_until > 0 and status == 'OK' and sid ~= '' then
    -- A banned session proxy: the session's slot must wait for the quarantine too.
    redis.call('ZADD', ready, 'XX', 'GT', ban_until, member)
  end
elseif outcome == 'error' then
  redis.call('HINCRBY', K_PSTATS, id .. ':err', 1)
  redis.call('HINCRBY', K_HSTATS, host .. ':err', 1)
  redis.call('HINCRBY', K_SITESTATS, 'err', 1)
end
if pace_wrote then pace_keep(learn_keep, tonumber(taught[8]), now) end
event = event or {'', 0, 0, '', 0, 0}
local reply = {status, now, ban_until, strikes}
for _, x in ipairs(event) do reply[#reply + 1] = x end
reply[#reply + 1] = pace_iv
reply[#reply + 1] = pace_event
reply[#reply + 1] = pace_ms(margin)
reply[#reply + 1] = margin_event
reply[#reply + 1] = free_at
return remember_release(K_LEASE_MEMO, reply, now_str)
