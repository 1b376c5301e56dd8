-- _pace.lua: what release.lua learns from a site's answers, and adaptive pacing: helpers prepended, like
-- _lib.lua's (which come first and which these use), to the scripts that call them (scripts.py,
-- LIB_FILES). The control law is argued in docs/pacing.md.

-- ==== Adaptive pacing (PROXY_SHARD_AUTOTHROTTLE_*; the control law is argued in docs/pacing.md) ====
-- P:pace:<site> HASH: one site's learned start-to-start interval, shared by every host and kept across
-- host restarts (written by release.lua only, when the caller has autothrottle on for the site):
--   iv     the interval in force, ms (fractional)
--   chg    when iv last changed, ms      eff  chg + the interval before it: a start from eff on was
--          scheduled by a release that already used iv; an earlier one may still be at the old pace
--   run    clean answers to requests started at or after eff, since the last change or rate-ban vote
--   vote   the proxy id of a pending rate-ban vote at this pace ('' none)
--   probe  the proxy trying a lower interval ('' none), piv that interval (ms), pat when it began (ms),
--          pn its clean answers at piv so far (those started within PACE_PROBE_TIGHT x piv of the proxy's
--          previous start), pls the start of its last answer (ms)
--   bad    the lowest interval known to fail (ms; 0: none yet): a failed probe's, or the one in force at
--          a raise; lowering stops at bad x (1 + PACE_MARGIN) until PACE_FORGET_RUN clean answers there
--          shrink bad by PACE_FORGET (the site may have loosened its rule)
--   prev   the interval before the last lowering, while that lowering is provisional (its first
--          PACE_LONE_RUN clean answers, and until pend): a vote meanwhile goes back to prev instead of
--          raising
--   pend   ms until which the last lowering stays provisional (see probe_needed)
--   firm   '1' once the interval in force carried PACE_LONE_RUN clean answers in a row (not provisional):
--          a raise from it is x PACE_UP_FIRM, from any other x PACE_UP
--   up, down, back, fail, skip, forget   raises, lowerings, lowerings undone, failed probes, rate bans
--          that changed nothing, floors lowered (counters)
-- The same hash holds what every mode learns from the site's answers (see site_learn below):
--   rest, p:<id>, and the path margin mg, mgs, mge, mgr, mgb, widen; and xp (when it expires, see
--   pace_keep) and ht (it was converted to the hashtable encoding, see pace_as_table).
-- A site's learned pace is forgotten a week after its last release (5.25 to 7 days: see pace_keep); a pace that learned nothing (the
-- interval it started from, nothing known to fail: a site touched a few times) goes with the site's
-- state, PROXY_SHARD_SITE_IDLE_TTL after its last release, like everything else of a site.
local PACE_KEEP_MS = 7 * 86400000
local PACE_UP = 1.5          -- a raise: interval x 1.5 (capped at the maximum),
local PACE_UP_FIRM = 1.1     -- ... x 1.1 from a firm interval (PACE_LONE_RUN clean answers in a row)
local PACE_DOWN_FIRST = 0.25  -- a probe tries interval x 0.25 while no interval is known to fail (see next_probe)
local PACE_CLEAN_RUN = 5     -- clean answers at the pace before a probe starts
local PACE_PROBE_RUN_FIRST = 3  -- clean answers of the probe proxy at the lower interval that adopt it,
local PACE_PROBE_RUN = 10       -- ... once an interval is known to fail (near the rule: a stricter test),
local PACE_BURST = 2            -- ... and at least 1 + this / (1 - lower / current): a site's limiter may
local PACE_PROBE_RUN_MAX = 40   -- let a burst through before it refuses (capped at this many answers);
-- Only a probe answer started within PACE_PROBE_TIGHT x the probe's interval after the probe proxy's
-- previous start counts: a probe the crawl did not keep busy proves nothing.
local PACE_PROBE_TIGHT = 1.25
local PACE_PROBE_MS = 60000  -- a probe that has not concluded after max(this, 20 x its interval) is dropped
local PACE_LONE_RUN = 20     -- clean answers at the pace that void a pending vote (it pointed at its proxy)
local PACE_MARGIN = 0.05
local PACE_FORGET_RUN = 1000
local PACE_FORGET = 0.95
local PACE_HORIZON_MIN = 30000  -- ms: the least a probe's gain is counted over (see next_probe)
local PACE_COST_PRIOR = 60000   -- ms: what a failed probe is assumed to cost while its ban's length is unknown
local PACE_BUSY_EWMA = 0.1      -- weight of a clean answer's slot time in bz

local function pace_ms(x) return string.format('%.3f', x) end

-- Clean answers that prove a lower interval `lower` against the one in force `iv`, for the probe proxy
-- (and, per proxy, for the provisional time after an adoption). A limiter with a burst allowance of b
-- requests (nginx limit_req burst, a token bucket) lets about 1 + b / (1 - lower / rule) requests
-- through at `lower` before refusing: a probe that stops earlier adopts an interval that fails later
-- on every proxy. The rule is at most `iv` (it answers clean), so 1 - lower / iv bounds that term.
local function probe_needed(lower, iv, bad)
  local needed = PACE_PROBE_RUN
  if bad == 0 then needed = PACE_PROBE_RUN_FIRST end
  local step = 1 - lower / iv
  if step > 0 then
    local burst = math.ceil(1 + PACE_BURST / step)
    if burst > needed then needed = burst end
  end
  if needed > PACE_PROBE_RUN_MAX then needed = PACE_PROBE_RUN_MAX end
  return needed
end

-- Apply one answer to the site's learned interval. Returns the interval this release paces its slot
-- with (ms: the probe's lower interval for the probe proxy, else the interval in force), what
-- happened and the interval in force (ms). `last` is the proxy's previous answer on the site (the mark
-- site_learn read: 'c' clean, nil none yet, anything else a ban). What happened: '' (nothing changed), 'probe' (this proxy starts trying a lower interval), 'down' (a probe
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
-- The interval a probe tries below `iv`, or nil when `iv` is at its floor (max(min, bad + margin)) or
-- the step is not worth its risk. Nothing failed yet: a long step (x PACE_DOWN_FIRST). Else halfway
-- (geometric) between the interval in force and the floor above the one known to fail (never the
-- floor itself when the two are close: it lies just above a failure): the rule lies between the two,
-- so such a probe fails about half the time, and a failure
-- costs its IP's quarantine on the site (`cost` ms, what the last failed probe cost: pfc). The probe is
-- tried when what it would win if it holds outweighs that: every proxy of the pool (its size, read
-- here) faster by iv / new - 1 for the horizon (as long again as the site has been paced: `age` ms, at
-- least PACE_HORIZON_MIN) against one IP's quarantine. A site that bans for minutes with a small pool
-- stops a few % above its rule; one that forgives in seconds is probed to the floor. Forgetting (bad x
-- PACE_FORGET) widens the step again.
local function next_probe(iv, bad, min_ms, cost, age)
  local floor = min_ms
  if bad * (1 + PACE_MARGIN) > floor then floor = bad * (1 + PACE_MARGIN) end
  if iv <= floor + 0.01 then return nil end  -- (0.01: iv is kept to 3 decimals)
  local new = iv * PACE_DOWN_FIRST
  if bad > 0 then new = math.sqrt(iv * floor) end
  if new < floor then new = floor end
  if bad > 0 and cost and cost > 0 then
    local horizon = age
    if not horizon or horizon < PACE_HORIZON_MIN then horizon = PACE_HORIZON_MIN end
    if redis.call('HLEN', K_PROXIES) * (iv / new - 1) * horizon < cost then return nil end
  end
  return new
end

-- A lowering from `old` to `new` ms: the site's slots given back under the old interval and not free
-- yet are brought forward by the difference (start + old -> start + new), never before a quarantine or
-- an overlap floor of theirs, nor before now; held slots are paced by their own release (which reads
-- the new interval). Without this, after 3 s -> 0.75 s every other proxy still waited out its 3 s.
-- Only for exact intervals (a randomized one's factor is the slot's own, unknown here).
local function repace(site, old, new, now)
  local delta = old - new
  if delta <= 0 then return end
  local due = redis.call('ZRANGEBYSCORE', K_READY, '(' .. istr(now), '+inf', 'WITHSCORES')
  for i = 1, #due, 2 do
    local member, at = due[i], tonumber(due[i + 1])
    local rec = redis.call('HMGET', K_SITE, member, floor_field(member))
    if not live_record(rec[1], now) then
      local sooner = at - delta
      if sooner < now then sooner = now end
      sooner = not_before_floor(next_free(site, id_of(member), sooner), rec[2])
      if sooner < at then redis.call('ZADD', K_READY, 'XX', sooner, member) end
    end
  end
end

local function pace_release(site, id, start, outcome, rate, start_ms, min_ms, max_ms, last, now, s, o, exact, slots,
    may_two)
  local K = K_PACE
  -- s: the hash's fields read by the caller, from s[o + 1]: iv eff run bad vote probe piv pat pn prev pend
  -- firm pls born pfc pfi, then conc_release's (release.lua reads them with site_learn's in one HMGET)
  local iv, eff = tonumber(s[o + 1]), tonumber(s[o + 2])
  local run, bad, vote = tonumber(s[o + 3]) or 0, tonumber(s[o + 4]) or 0, s[o + 5] or ''
  local probe, piv, pat, pn = s[o + 6] or '', tonumber(s[o + 7]) or 0, tonumber(s[o + 8]) or 0, tonumber(s[o + 9]) or 0
  local prev, pend = tonumber(s[o + 10]), tonumber(s[o + 11]) or 0
  local firm, pls = s[o + 12] == '1', tonumber(s[o + 13])
  local born, cost = tonumber(s[o + 14]), tonumber(s[o + 15])
  local failed_ip = s[o + 16] or ''
  -- bz: how long the site's answers hold a slot (ms, EWMA over clean answers of the use's start to its
  -- release); a probe proves only gaps its proxy can keep (see try_probe)
  local bz = tonumber(s[o + 18])
  local two = nil  -- the interval a probe would try if the site allowed two requests in flight per IP
  if failed_ip ~= '' then
    -- A failed probe's IP whose quarantine length the site did not say: what it cost is known when it
    -- answers clean on the site again (until then assumed PACE_COST_PRIOR).
    local fid, fat = string.match(failed_ip, '^(.*)|(%d+)$')
    if fid == id and outcome == 'ok' and fat then
      cost = now - tonumber(fat)
      redis.call('HSET', K, 'pfc', istr(cost), 'pfi', '')
    elseif not cost then
      cost = PACE_COST_PRIOR
    end
  end
  if not iv or not eff then
    -- The site's first answer: every request in flight was started at the start interval (or not paced at
    -- all: nothing came before it), so every answer counts towards the first clean run (eff 0).
    iv, eff, born = start_ms, 0, now
    redis.call('HSET', K, 'iv', pace_ms(iv), 'chg', istr(now), 'eff', '0', 'run', 0, 'bad', 0, 'vote', '',
      'probe', '', 'born', istr(now))
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
    local before, until_ms = '', 0
    if what == 'down' then
      -- Provisional for PACE_LONE_RUN clean answers, and until every proxy could have used the new
      -- interval twice as often as its probe had to (a burst allowance runs out per IP, and the probe's
      -- count assumed the rule at `iv`: a rule just above `new` lets more through). Probes go on
      -- meanwhile: a lowering undone takes those below it along.
      before = pace_ms(iv)
      until_ms = now + iv + 2 * probe_needed(new, iv, bad) * new
    end
    redis.call('HSET', K, 'iv', pace_ms(new), 'chg', istr(now), 'eff', istr(now + iv), 'run', 0, 'vote', '',
      'probe', '', 'prev', before, 'pend', istr(until_ms), 'firm', '')
    redis.call('HINCRBY', K, what, 1)
    if what == 'down' and exact then repace(site, iv, new, now) end
    -- lo: the interval a probe last proved clean (a lowering; or the one a provisional lowering went
    -- back to): where a site group linked through this site starts (store_links.py)
    if what == 'down' or what == 'back' then redis.call('HSET', K, 'lo', pace_ms(new)) end
    iv, event, probe = new, what, ''
  end
  -- This proxy starts trying the next lower interval (next_probe), if there is one worth it and requests
  -- wait for the site's slots (P:waiting:<site>, set by a lease that answered WAIT in the last 6 s): a
  -- lower interval is useless, and untestable, when the crawl does not use the one in force to the full.
  -- A probe proves only the gaps its proxy can keep: answers that hold a slot bz ms free its slots
  -- every bz / slots ms at best, so a probe tries no lower than that. With one slot per IP and the
  -- interval already there, the next step needs two requests in flight per IP: `two` asks
  -- conc_release to try them (`may_two`: the caller allows it, the site's verdict cc is not given yet
  -- and nobody is trying).
  local function try_probe()
    if s[o + 19] == id then return false end  -- (ccp: it is trying two slots, see conc_release)
    local testable = (bz or 0) / slots
    local floor = min_ms
    if testable > floor then floor = testable end
    local lower = next_probe(iv, bad, floor, cost, born and now - born)
    if not lower and may_two and slots == 1 and testable >= iv * (1 - PACE_MARGIN) then
      -- the IP waits on its answers: two slots would run it at the next step, or at iv itself
      two = next_probe(iv, bad, min_ms, cost, born and now - born) or iv
    end
    if not lower or redis.call('EXISTS', K_WAITING) ~= 1 then return false end
    redis.call('HSET', K, 'probe', id, 'piv', pace_ms(lower), 'pat', istr(now), 'pn', 0, 'run', 0,
      'pls', istr(start))
    probe, piv = id, lower
    return true
  end
  if probe ~= '' and probe == id then
    -- The probe proxy's answer: its uses from the probe's start on are paced by piv.
    if outcome == 'ok' then
      if start >= pat then
        if pls and start - pls <= piv * PACE_PROBE_TIGHT then pn = pn + 1 end
        if pn >= probe_needed(piv, iv, bad) then
          change(piv, 'down')
          -- The probe goes on lower at once (its IP has just run the new interval for a burst's worth
          -- of answers): a descent in one proxy's steps, not one per proving of every proxy.
          try_probe()
        else
          redis.call('HSET', K, 'pn', pn, 'pls', istr(start))
        end
      end
    elseif outcome == 'ban' and rate and start >= pat then
      redis.call('HSET', K, 'bad', pace_ms(piv), 'probe', '')
      redis.call('HINCRBY', K, 'fail', 1)
      probe, bad, event = '', piv, 'fail'
    elseif outcome ~= 'unknown' then  -- another ban, an error, a dead proxy: no verdict on the pace
      redis.call('HSET', K, 'probe', '')
      probe = ''
    end
  elseif outcome == 'ok' and (start >= eff or prev) then
    -- (an answer started before eff was paced the old way: it counts only towards a provisional
    -- lowering's next probe, which needs no clean run: its probe's IP just proved the interval)
    local counted = start >= eff
    if counted then
      run = run + 1
      local busy = now - start
      if not bz then bz = busy else bz = bz + PACE_BUSY_EWMA * (busy - bz) end
      if not firm and not prev and run >= PACE_LONE_RUN then
        redis.call('HSET', K, 'firm', '1')  -- a long clean run: failures here are marginal (see 'up')
        firm = true
      end
    end
    if probe ~= '' and now > pat + math.max(PACE_PROBE_MS, 20 * piv) then
      redis.call('HSET', K, 'probe', '')  -- its proxy was removed, or never came back
      probe = ''
    end
    if probe == '' and (run >= PACE_CLEAN_RUN or prev) and try_probe() then
      event = 'probe'
    elseif counted then
      if probe == '' and bad > 0 and run >= PACE_FORGET_RUN then
        redis.call('HSET', K, 'bad', pace_ms(bad * PACE_FORGET), 'run', 0, 'vote', '')
        redis.call('HINCRBY', K, 'forget', 1)
        event = 'forget'
      elseif (vote ~= '' or (prev and now >= pend)) and run >= PACE_LONE_RUN then
        if prev and now >= pend then
          redis.call('HSET', K, 'run', run, 'vote', '', 'prev', '', 'bz', pace_ms(bz))
        else
          redis.call('HSET', K, 'run', run, 'vote', '', 'bz', pace_ms(bz))
        end
      else
        redis.call('HSET', K, 'run', run, 'bz', pace_ms(bz))
      end
    end
  elseif outcome == 'ban' and rate then
    local votes = start >= eff and last == 'c'
    if votes and prev then  -- a vote against a lowering still provisional: undo it, no raise
      if iv > bad then redis.call('HSET', K, 'bad', pace_ms(iv)) end
      change(prev, 'back')
    elseif votes and ((vote ~= '' and vote ~= id) or redis.call('HLEN', K_PROXIES) < 2) then
      -- From a firm interval the site's limit is just below it (path jitter, a slightly stricter rule):
      -- a small step; from an interval that never ran clean for long, a large one.
      local new = iv * PACE_UP
      if firm then new = iv * PACE_UP_FIRM end
      if new > max_ms then new = max_ms end
      if iv > bad then redis.call('HSET', K, 'bad', pace_ms(iv)) end
      change(new, 'up')
    else
      if votes then redis.call('HSET', K, 'vote', id, 'run', 0) end
      redis.call('HINCRBY', K, 'skip', 1)
      event = 'skip'
    end
  end
  -- whether the site taught something worth a week (see PACE_KEEP_MS): an interval other than the one
  -- it started from, or one known to fail
  local learned = bad > 0 or math.abs(iv - start_ms) >= 0.001
  if probe ~= '' and probe == id then return piv, event, iv, learned, two end
  return iv, event, iv, learned, two
end

-- ==== Learned concurrency: requests in flight per IP (adaptive pacing; docs/pacing.md) ====
-- A site whose answers hold a slot longer than its interval keeps each IP waiting on answers, not on
-- the interval, and probes cannot go lower with one slot per IP (they prove only gaps their proxy can
-- keep: see try_probe). If the site tolerates two requests in flight per IP, two slots per proxy let
-- the descent go on. In P:pace:<site>:
--   cc   the verdict: '' none yet, '2' two requests in flight per IP proved clean (the site's slots per
--        proxy are 2: its hash's c), '1' a second request in flight met a ban (not tried again while the
--        pace hash lives)
--   bz   how long answers hold a slot, ms (pace_release)
--   ccp  the proxy trying two slots ('' none), cct when it began (ms), ccn its clean answers to requests
--        that overlapped its other slot's (that slot's record still live at the release); after a '1',
--        ccp stays and cce is when it ended: the bans of its requests started before are no votes
-- The probe is weighed like an interval probe (next_probe): it starts when every proxy of the pool
-- faster by max(iv, bz) / max(the wanted step, bz / 2) - 1 for the horizon outweighs one IP's quarantine (the
-- cost a failed interval probe showed, PACE_COST_PRIOR until one did), and only while requests wait for
-- the site's slots. While it runs the site's c is 2 with one proxy holding a second slot: leases keep
-- the IP's two starts the interval apart (lease.lua, ip_field), so it tests overlap, not a faster pace.
-- A ban of the probe proxy ends it ('1') and is no vote on the interval (release.lua); CC_RUN
-- overlapped clean answers give every proxy two slots (the site relearns the pool: learn() spaces
-- each new slot from its first).
local CC_RUN = 8
local CC_PROBE_MS = 60000  -- a probe not concluded after max(this, 40 x the interval) is dropped

-- The concurrency step of one answer (release.lua, after pace_release): returns '' or the event
-- 'conc_probe', 'conc_up' or 'conc_fail'. `s`: the pace hash fields the release read, cc bz ccp cct ccn
-- from s[o + 1]; `iv` the interval in force (ms), `c` the site's slots per proxy as the release read
-- them; `two`: the step pace_release wanted and one slot could not test (nil: none); `may_probe`: this
-- proxy is not the interval probe's; `cost`/`age` as for next_probe; `allow`: the caller allows two in
-- flight per IP (PROXY_SHARD_AUTOTHROTTLE_OVERLAP).
-- The site hash's CONC_RAISED field marks slots per proxy raised by this learning (not the caller's
-- concurrency): only those go back to one when the caller no longer allows two.
local CONC_RAISED = '@cc'
local function conc_release(id, member, start, outcome, iv, c, now, s, o, two, may_probe, cost, age, allow)
  local cc, bz, ccp = s[o + 1] or '', tonumber(s[o + 2]) or 0, s[o + 3] or ''
  local cct, ccn = tonumber(s[o + 4]) or 0, tonumber(s[o + 5]) or 0
  local spacing = istr(math.ceil(iv))
  local function one_slot()  -- (a proxy's slots above the first are dropped by the lease that meets them)
    redis.call('HSET', K_SITE, 'c', 1)
    redis.call('HDEL', K_SITE, CONC_RAISED)
  end
  local function drop(verdict)  -- end proxy ccp's try: verdict '1' (a ban) or '' (none)
    redis.call('ZREM', K_READY, ccp .. '/1')
    one_slot()
    if verdict == '1' then  -- ccp stays: its requests in flight meanwhile are no votes either (release.lua)
      redis.call('HSET', K_PACE, 'cc', '1', 'cce', istr(now))
    else
      redis.call('HSET', K_PACE, 'ccp', '')
    end
  end
  if not allow then
    -- Turned off after the site learned two, or while one proxy tried them: one per IP from now on.
    -- A try ends with no verdict; a verdict '2' stays (turned on again, the site has its two back at once).
    if cc == '' and ccp ~= '' then
      drop('')
      return 'conc_off'
    end
    if cc == '2' and c > 1 and redis.call('HEXISTS', K_SITE, CONC_RAISED) == 1 then
      one_slot()
      return 'conc_off'
    end
    return ''
  end
  if cc == '2' then
    if c < 2 then  -- the site's state was built again (idle, a new group) with the caller's one slot
      redis.call('HSET', K_SITE, 'c', 2, 'seq', 0, IP_SPACING, spacing, CONC_RAISED, 1)
    end
    return ''
  end
  if cc == '1' then return '' end
  if ccp ~= '' then
    if ccp == id and start and start >= cct then
      if outcome == 'ok' then
        local other = id .. '/1'
        if string.sub(member, -2) == '/1' then other = id .. '/0' end
        if live_record(redis.call('HGET', K_SITE, other), now) then
          if ccn + 1 >= CC_RUN then
            redis.call('HSET', K_SITE, 'seq', 0, IP_SPACING, spacing)  -- learn() adds every second slot
            redis.call('HSET', K_PACE, 'cc', '2', 'ccp', '')
            return 'conc_up'
          end
          redis.call('HSET', K_PACE, 'ccn', ccn + 1)
        end
      elseif outcome == 'ban' then
        drop('1')
        return 'conc_fail'
      elseif outcome ~= 'unknown' then  -- an error, a dead proxy: no verdict
        drop('')
      end
    elseif now > cct + math.max(CC_PROBE_MS, 40 * iv) then
      drop('')  -- its proxy was removed, quarantined or never overlapped
    end
    return ''
  end
  if not two or not start or c > 1 or not may_probe then return '' end
  -- one slot per IP runs it every max(iv, bz) ms; two, every max(step, bz / 2)
  local step = two
  if bz / 2 > step then step = bz / 2 end
  local now_gap = iv
  if bz > now_gap then now_gap = bz end
  local horizon = age
  if not horizon or horizon < PACE_HORIZON_MIN then horizon = PACE_HORIZON_MIN end
  if redis.call('HLEN', K_PROXIES) * (now_gap / step - 1) * horizon < cost
      or redis.call('EXISTS', K_WAITING) ~= 1 then
    return ''
  end
  local at = start + iv
  if at < now then at = now end
  redis.call('HSET', K_SITE, 'c', 2, IP_SPACING, spacing, ip_field(id), istr(start), CONC_RAISED, 1)
  redis.call('ZADD', K_READY, 'NX', at, id .. '/1')
  redis.call('HSET', K_PACE, 'ccp', id, 'cct', istr(now), 'ccn', 0)
  return 'conc_probe'
end

-- ==== What every mode learns from a site's answers (release.lua, before pacing; docs/pacing.md) ====
-- In P:pace:<site> (kept after its last write for the site's idle TTL, or PACE_KEEP_MS with adaptive
-- pacing once it learned something, whose learned interval outlives restarts):
--   p:<id> the proxy's last answer on the site: 'c' clean, 'f<ms>@<since>' a brief (rate-type) quarantine
--          of that length after clean answers, in a series of them whose first ban was at `since`
--          ('g...': without any clean answer before, e.g. a 429 on first contact), 'b' a hard block. A
--          rate-type ban (kind 1) and any ban after a clean answer or a brief quarantine are brief: they
--          start from the site's rest, not the ban TTL (see release.lua)
--   rest   "rest|lo|hi": the site's rest after a rate-type ban, ms (at least the caller's minimum), and
--          the bounds of its ban length (rest_of, rest_guess): an IP refused again after a rest of T
--          ('f' only: an IP the site blacklists for good, which never answered clean, must not teach
--          every IP a long rest) says lo >= T; one back clean T after its series began, hi <= T
--   mg     the path margin, ms, added to a fixed interval (not to a learned one, which moves by itself;
--          the caller's prior share of the interval, at most MARGIN_PRIOR_MAX, until the site teaches one):
--          the site counts arrivals, and path jitter brings some closer than they were sent. A strike-like
--          answer (a rate-type ban, or a block after a clean answer) of a request started at or after
--          mge widens it by mgs (which then doubles) for every host; each MARGIN_RUN clean answers narrow
--          it by MARGIN_DECAY (mgs back to MARGIN_STEP), never below MARGIN_KEEP x mgb, the widest
--          margin that proved too narrow, itself x MARGIN_FORGET each MARGIN_FORGET_RUN clean answers
--   mgr    clean answers since the last change (counted only while a margin or mgb is set)
--   widen  widenings (a counter)
local LEARN_REST_DECAY = 0.9
local MARGIN_STEP = 5          -- ms
-- A site's margin before it taught any (the caller's share of the interval) is at most this many ms; it
-- decays like any margin while answers are clean.
local MARGIN_PRIOR_MAX = 20
local MARGIN_RUN = 200
local MARGIN_DECAY = 0.9
local MARGIN_KEEP = 1.25
local MARGIN_FORGET_RUN = 1000
local MARGIN_FORGET = 0.8

-- The length of a brief quarantine a mark records (ms), or nil, whether the proxy had answered clean
-- on the site before that series of brief quarantines ('f'; 'g': it had not), and when the series'
-- first ban was (ms; nil in a mark written before marks said).
local function brief_of(mark)
  if not mark then return nil, false end
  local letter, ms, since = string.match(mark, '^([fg])(%d+)@?(%d*)$')
  return tonumber(ms), letter == 'f', tonumber(since)
end

-- The site's rest field: "rest|lo|hi" (ms; a plain number before the bounds were kept), the bounds of
-- the site's ban length that hold whether a ban runs from its strike or starts again at each refused
-- request. lo: the longest rest after which an IP was refused again (bans last longer); hi: the shortest
-- time from a series' first ban to a clean answer of its IP (bans last no longer). Either may be nil.
local function rest_of(field)
  if not field then return nil end
  local rest, lo, hi = string.match(field, '^(%d+)|(%d*)|(%d*)$')
  if not rest then return tonumber(field) end
  return tonumber(rest), tonumber(lo), tonumber(hi)
end

-- The rest the bounds call for, nil while no IP came back clean: halfway (geometric) between lo and
-- hi, so it bisects towards the site's ban length; at most LEARN_REST_DECAY x hi, at least REST_ABOVE_LO
-- x lo (never above hi). lo fades (x REST_LO_FADE per clean return), so the rest creeps back down and
-- finds a site that shortened its bans, at the cost of a refused return now and then; a refusal costs
-- little where bans run from their strike (the series ends at hi from its start, see release.lua).
local REST_ABOVE_LO = 1.1
local REST_LO_FADE = 0.98
local function rest_guess(lo, hi)
  if not hi then return nil end
  local guess = LEARN_REST_DECAY * hi
  if lo and lo < hi then
    guess = math.min(guess, math.sqrt(lo * hi))
    if REST_ABOVE_LO * lo > guess then guess = math.min(REST_ABOVE_LO * lo, hi) end
  end
  return guess
end

local function rest_field(rest, lo, hi)
  return istr(math.floor(rest)) .. '|' .. (lo and istr(math.floor(lo)) or '') .. '|'
    .. (hi and istr(math.floor(hi)) or '')
end

-- A proxy's first mark grows the pace hash with the pool: once it may be big it goes to the hashtable
-- encoding (see as_table), once; field ht says so (read with the hash's other fields: `converted`).
-- pace_keep drops ht when it refreshes the expiry, so a hash a restart loaded back as a listpack is
-- converted again at the next first mark after that refresh (within a quarter of the hash's keep, as
-- the site hash's ht). Before ht, every first mark on a hash of 64 fields or more converted it again:
-- with a pool of 10,000, about 3 more commands and a 2 KB string per release until each proxy had a
-- mark. True when this call converted it.
local function pace_as_table(K, last, converted, set)
  if last or converted or redis.call('HLEN', K) < BIG_HASH then return false end
  as_table(K)
  set[#set + 1] = 'ht'; set[#set + 1] = '1'
  return true
end

-- Learn from one answer. `kind`: 0 no ban, 1 rate-type ban, 2 block, 3 failed content check;
-- `interval` the fixed interval paced with (ms; 0 for none or adaptive: no margin); `converted`: the
-- hash's ht (see pace_as_table). Returns the proxy's previous mark, the site's rest (ms) and the margin
-- in force (ms) with what this answer did to it ('' or 'widen'), whether it wrote to the hash, and
-- whether the hash is in the hashtable encoding now (as far as ht tells).
local function site_learn(site, id, start, outcome, kind, rest_min, interval, prior_share, now, s, converted)
  local K = K_PACE
  local last = s[1]
  local rest, lo, hi = rest_of(s[2])
  rest = rest or rest_min
  if rest < rest_min then rest = rest_min end
  local prior = math.min(prior_share * interval, MARGIN_PRIOR_MAX)
  local mg, mgs, mge = tonumber(s[3]) or prior, tonumber(s[4]) or MARGIN_STEP, tonumber(s[5]) or 0
  local mgr, mgb = tonumber(s[6]) or 0, tonumber(s[7]) or 0
  local set = {}
  local event = ''
  if outcome == 'ok' then
    local brief, _, since = brief_of(last)
    if brief then
      -- Back clean from a series of brief quarantines that began at `since` (an older mark: from its
      -- last quarantine alone): the site's bans last no longer than that (hi); the rest comes down to
      -- what the bounds call for (rest_guess), never up.
      -- (only from a request sent within the series: one in flight on another slot of the IP when the
      -- series began, or of unknown start, says nothing of how long the ban lasted)
      local lasted = brief
      if since then lasted = start and start >= since and start - since or nil end
      if lasted and (not hi or lasted < hi) then hi = lasted end
      if lo then lo = lo * REST_LO_FADE end
      local guess = rest_guess(lo, hi)
      if guess and guess < rest then rest = guess end
      if rest < rest_min then rest = rest_min end
      local field = rest_field(rest, lo, hi)
      if s[2] ~= field then set[#set + 1] = 'rest'; set[#set + 1] = field end
    end
    if last ~= 'c' then set[#set + 1] = 'p:' .. id; set[#set + 1] = 'c' end
    if interval > 0 and (mg > 0 or mgb > 0) and start and start >= mge then
      mgr = mgr + 1
      if mgr % MARGIN_FORGET_RUN == 0 then
        mgb = mgb * MARGIN_FORGET
        set[#set + 1] = 'mgb'; set[#set + 1] = pace_ms(mgb)
      end
      if mgr % MARGIN_RUN == 0 and mg > MARGIN_KEEP * mgb then
        mg = mg * MARGIN_DECAY
        if mg < MARGIN_KEEP * mgb then mg = MARGIN_KEEP * mgb end
        if mg < 0.5 then mg = 0 end
        set[#set + 1] = 'mg'; set[#set + 1] = pace_ms(mg)
        set[#set + 1] = 'mgs'; set[#set + 1] = MARGIN_STEP
      end
      set[#set + 1] = 'mgr'; set[#set + 1] = mgr
    end
  elseif outcome == 'ban' and interval > 0 and start and start >= mge
      and (kind == 1 or (kind >= 2 and last == 'c')) then
    -- strike-like: this request was paced by the margin in force and still met the site's limit
    if mg > mgb then mgb = mg end
    mg = mg + mgs
    if mg > interval then mg = interval end
    set[#set + 1] = 'mg'; set[#set + 1] = pace_ms(mg)
    set[#set + 1] = 'mgs'; set[#set + 1] = mgs * 2
    set[#set + 1] = 'mge'; set[#set + 1] = istr(now)
    set[#set + 1] = 'mgb'; set[#set + 1] = pace_ms(mgb)
    set[#set + 1] = 'mgr'; set[#set + 1] = 0
    redis.call('HINCRBY', K, 'widen', 1)
    event = 'widen'
  end
  if #set > 0 then
    -- a proxy's first mark: the hash grows with the pool
    if pace_as_table(K, last, converted, set) then converted = true end
    redis.call('HSET', K, unpack(set))
  end
  return last, rest, mg, event, #set > 0, converted, lo, hi
end

-- Record the proxy's answer on the site after a ban (see p:<id> above): 'f<ms>@<since>' or
-- 'g<ms>@<since>' a brief quarantine of that length in a series that began at `since` (this ban, unless
-- the last mark was one of the series), else 'b'.
local function site_mark(id, last, brief_ms, converted, now)
  local mark = 'b'
  if brief_ms then
    local before, lineage, since = brief_of(last)
    if not before then since = now elseif not since then since = now - before end
    local letter = 'g'
    if last == 'c' or lineage then letter = 'f' end
    mark = letter .. istr(brief_ms) .. '@' .. istr(since)
  end
  if mark ~= last then
    local set = {'p:' .. id, mark}
    pace_as_table(K_PACE, last, converted, set)
    redis.call('HSET', K_PACE, unpack(set))
  end
end

-- The pace hash's expiry (release.lua, once per release that wrote to it): `keep_ms` from now, moved
-- only later, and refreshed only once a quarter of it has passed: the deadline is kept in field xp,
-- read with the hash's other fields, so most releases write no PEXPIRE. Call it after a write only (it
-- must not create the hash).
local function pace_keep(keep_ms, xp, now)
  local want = now + keep_ms
  if xp and xp >= want - math.floor(keep_ms / 4) then return end
  redis.call('HSET', K_PACE, 'xp', istr(want))
  -- its encoding is checked again (see pace_as_table); a hash with no xp yet is new: nothing to drop
  if xp then redis.call('HDEL', K_PACE, 'ht') end
  redis.call('PEXPIRE', K_PACE, keep_ms)
end
