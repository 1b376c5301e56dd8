-- site_link.lua: learn, from bans, which sites share one blacklist (a site group nobody declared).
-- Two sites behind one anti-bot system count one IP's requests together: a proxy quarantined on one of
-- them (a rate ban) is then banned on the other too, at its next request there, although it broke no
-- rule of that site alone. So: a rate ban of proxy X on site B that follows a clean answer of X on B
-- (its mark in B's pace hash, see site_mark in _pace.lua: 'c' when the ban was spared by the breaker,
-- 'f...' when it started a quarantine), while X is quarantined on site A, is *evidence* that A and B
-- share a blacklist; the same evidence from ARGV[8] distinct proxies within ARGV[4] ms of the first,
-- the last at least ARGV[11] ms after the first, links them for every host: both are then leased,
-- paced and quarantined as one site group. One proxy's coincidences never link (a proxy that is bad everywhere is banned everywhere), nor do bans
-- that follow bans (a site rejecting every IP at once: an opening wave, a breaker's probe round).
-- And a clean answer on B to a request started while its proxy rested from A (ARGV[9] = A) proves B
-- does not share A's blacklist: it vetoes linking the two for ARGV[10] ms and drops their pending
-- evidence. Independent sites whose bans come in bursts together (both paced too fast at once) give
-- such answers all the time; a shared blacklist never does. The span (ARGV[11]) keeps one burst from
-- linking: independent sites that tighten their rules at once ban every proxy on all of them within a
-- second, before any clean answer can veto; a shared blacklist goes on banning across the two.
-- Overlap evidence (ARGV[12]): a rate ban of X on B, for a request sent while X was in flight on A and
-- answered before it, is evidence too: B counted X's request to A (a second request in flight from one
-- IP) although B never saw it. It needs no earlier clean answer and no quarantine: it is how a shared
-- blacklist shows at a crawl's opening wave, when every IP goes to every site at once. A coincidence
-- (B banning X for its own reasons while X happened to be in flight on an independent A) is told apart
-- by the overlaps that stay clean: a clean answer of B to a request sent while X was in flight on A
-- (ARGV[12] with ARGV[3] = 0) vetoes overlap evidence for the pair; a clean answer while X rested from A
-- (ARGV[9]) vetoes both kinds. Overlap evidence links when ARGV[8] distinct proxies gave it within
-- ARGV[4] ms and the first is ARGV[13] ms old with no veto since (the clean overlaps of the same
-- opening wave answer after the bans do); any call, a read included, makes a settled link.
--   P:linkban  HASH  proxy id -> "<site key>|<until ms>": its latest rate-ban quarantine
--   P:linkev   HASH  "<a>|<b>" (a < b, group keys) -> "<ms of the first>|<proxy id>|...": pending evidence,
--                    or "-<ms>": a veto (a clean answer that proved them apart) since then
--                    "o|<a>|<b>" -> the same for overlap evidence and its vetoes
--   P:links    HASH  site key -> its group's key (the least key of the group; a group's own key has
--                    no field), and "~v" -> the map's version (raised at each link). Kept ARGV[6] ms
--                    after the last link; an operator forgets every learned group with DEL.
-- KEYS: linkban linkev links pace   (roles in order, see engine/keyset.py; pace: ARGV[1]'s)
-- ARGV[1]  the site key the ban was on (as leased: already mapped to its group)
-- ARGV[2]  proxy id    ARGV[3] the quarantine's length, ms (0: only read the map)
-- ARGV[4]  how long one proxy's evidence waits for another's, ms
-- ARGV[5]  most sites a learned group may hold (a link that would make it larger is refused)
-- ARGV[6]  how long the learned map is kept after its last link, ms
-- ARGV[7]  the map's version the caller knows ("" or a number)
-- ARGV[8]  distinct proxies whose evidence links two sites
-- ARGV[9]  "" or, for a clean answer on ARGV[1] by ARGV[2] while it rested from that site, that site
-- ARGV[10] how long a veto holds, ms
-- ARGV[11] the least time between the first evidence and the one that links, ms
-- ARGV[12] "" or the site (group key) the proxy was in flight on, on the caller's host, for the whole of
--          this request: with ARGV[3] > 0 the ban came while it was (overlap evidence), with ARGV[3] = 0
--          the request was answered clean while it was (an overlap veto)
-- ARGV[13] how long overlap evidence settles before it links, ms (a veto may come meanwhile)
-- Replies:
--   {version, linked, now}              the caller's version is current (linked: "" or "<a>|<b>" just
--                                       linked by bans while quarantined, "<a>|<b>|o" by overlap
--                                       evidence; now: the Redis clock, ms)
--   {version, linked, now, k1, g1, ...} else the map too: each linked site key and its group's key

local bad = arg_str(1, 'site') or arg_str(2, 'proxy id') or arg_int(3, 'quarantine ms', 0, MAX_MS)
  or arg_int(4, 'evidence ms', 1, MAX_MS) or arg_int(5, 'group size', 2, MAX_CONCURRENCY)
  or arg_int(6, 'keep ms', 1, MAX_MS) or arg_str(7, 'version', true)
  or arg_int(8, 'evidence proxies', 1, MAX_CONCURRENCY) or arg_str(9, 'rested from', true)
  or arg_int(10, 'veto ms', 1, MAX_MS) or arg_int(11, 'span ms', 0, MAX_MS)
  or arg_str(12, 'overlapped with', true) or arg_int(13, 'settle ms', 0, MAX_MS)
if bad then return redis.error_reply(bad) end

local site, id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local evidence_ms, max_size, keep_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local needed, veto_ms, span_ms = tonumber(ARGV[8]), tonumber(ARGV[10]), tonumber(ARGV[11])
local overlapped, settle_ms = ARGV[12], tonumber(ARGV[13])
local now = now_ms()
local linked = ''

local function group_of(key)
  return redis.call('HGET', K_LINKS, key) or key
end

-- Link the groups a < b: every site of b (and b itself) now points at a.
local function link(a, b)
  local map = redis.call('HGETALL', K_LINKS)
  local size_a, size_b, of_b = 1, 1, {}
  for i = 1, #map, 2 do
    if map[i + 1] == a then size_a = size_a + 1
    elseif map[i + 1] == b then size_b = size_b + 1; of_b[#of_b + 1] = map[i] end
  end
  if size_a + size_b > max_size then return false end
  for _, key in ipairs(of_b) do redis.call('HSET', K_LINKS, key, a) end
  redis.call('HSET', K_LINKS, b, a)
  redis.call('HINCRBY', K_LINKS, '~v', 1)
  redis.call('PEXPIRE', K_LINKS, keep_ms)
  return true
end

local function pair_of(x, y)
  local a, b = group_of(x), group_of(y)
  if a > b then a, b = b, a end
  if a == b then return nil end
  return a .. '|' .. b, a, b
end

local function vetoed_since(field)
  local ev = redis.call('HGET', K_LINKEV, field)
  if ev and string.sub(ev, 1, 1) == '-' and now - tonumber(string.sub(ev, 2)) <= veto_ms then return ev end
  return nil
end

local function veto(field)
  redis.call('HSET', K_LINKEV, field, '-' .. istr(now))
  if redis.call('PTTL', K_LINKEV) < veto_ms then redis.call('PEXPIRE', K_LINKEV, veto_ms) end
end

-- Pending evidence of one field: the first one's ms and the distinct proxies (none when it is a veto or
-- older than the evidence window).
local function pending(ev)
  local first, seen = now, {}
  if ev and string.sub(ev, 1, 1) ~= '-' then
    local parts = {}
    for part in string.gmatch(ev, '[^|]+') do parts[#parts + 1] = part end
    if now - tonumber(parts[1]) <= evidence_ms then
      first = tonumber(parts[1])
      for i = 2, #parts do seen[#seen + 1] = parts[i] end
    end
  end
  return first, seen
end

-- Add proxy id's evidence to field (pair a|b); link when enough distinct proxies gave it and the first
-- is at least span ms old.
local function evidence(field, a, b, span)
  local first, seen = pending(redis.call('HGET', K_LINKEV, field))
  local known = false
  for _, by in ipairs(seen) do if by == id then known = true end end
  if not known then seen[#seen + 1] = id end
  if #seen >= needed and now - first >= span then
    redis.call('HDEL', K_LINKEV, field)
    if link(a, b) then linked = a .. '|' .. b .. (string.sub(field, 1, 2) == 'o|' and '|o' or '') end
  elseif not known then
    redis.call('HSET', K_LINKEV, field, istr(first) .. '|' .. table.concat(seen, '|'))
    if redis.call('PTTL', K_LINKEV) < evidence_ms then redis.call('PEXPIRE', K_LINKEV, evidence_ms) end
    return true
  end
  return false
end

if ARGV[9] ~= '' then
  local pair = pair_of(ARGV[9], site)
  if pair then veto(pair) end
elseif overlapped ~= '' and ttl == 0 then
  local pair = pair_of(overlapped, site)
  if pair then veto('o|' .. pair) end
elseif ttl > 0 then
  local prev = redis.call('HGET', K_LINKBAN, id)
  redis.call('HSET', K_LINKBAN, id, site .. '|' .. istr(now + ttl))
  if redis.call('PTTL', K_LINKBAN) < ttl then redis.call('PEXPIRE', K_LINKBAN, ttl) end
  local other, until_ms
  if prev then other, until_ms = string.match(prev, '^(.*)|(%d+)$') end
  if other and tonumber(until_ms) > now then
    local pair, a, b = pair_of(other, site)
    local mark = pair and redis.call('HGET', K_PACE, 'p:' .. id)
    if pair and not vetoed_since(pair) and mark and (mark == 'c' or string.sub(mark, 1, 1) == 'f') then
      evidence(pair, a, b, span_ms)
    end
  end
  if overlapped ~= '' and linked == '' then
    local pair, a, b = pair_of(overlapped, site)
    if pair and not vetoed_since(pair) and not vetoed_since('o|' .. pair)
        and evidence('o|' .. pair, a, b, settle_ms) then
      local list = redis.call('HGET', K_LINKEV, '~o') or ''
      if not string.find(' ' .. list .. ' ', ' o|' .. pair .. ' ', 1, true) then
        redis.call('HSET', K_LINKEV, '~o', list == '' and 'o|' .. pair or list .. ' o|' .. pair)
      end
    end
  end
end

-- Overlap evidence that has settled links at any call (a read included): the bans of an opening wave
-- all come at once, and nothing else may be reported before the first host reads the map again. The
-- fields with pending overlap evidence are listed in '~o' (so a read does not scan the vetoes).
local list = redis.call('HGET', K_LINKEV, '~o')
if list then
  local keep = {}
  for field in string.gmatch(list, '%S+') do
    local a, b = string.match(field, '^o|(.*)|(.*)$')
    local ev = redis.call('HGET', K_LINKEV, field)
    local first, seen = pending(ev)
    if #seen == 0 then
      -- vetoed (the field is the veto now), linked, or too old (dropped)
      if ev and string.sub(ev, 1, 1) ~= '-' then redis.call('HDEL', K_LINKEV, field) end
    elseif vetoed_since(a .. '|' .. b) then
      redis.call('HDEL', K_LINKEV, field)
    elseif linked == '' and #seen >= needed and now - first >= settle_ms then
      redis.call('HDEL', K_LINKEV, field)
      -- (the groups may have changed since: link what the two sites belong to now)
      local pair, x, y = pair_of(a, b)
      if pair and link(x, y) then linked = pair .. '|o' end
    else
      keep[#keep + 1] = field
    end
  end
  if #keep > 0 then redis.call('HSET', K_LINKEV, '~o', table.concat(keep, ' '))
  else redis.call('HDEL', K_LINKEV, '~o') end
end

local version = redis.call('HGET', K_LINKS, '~v') or '0'
if version == ARGV[7] then return {version, linked, now} end
local reply = {version, linked, now}
local map = redis.call('HGETALL', K_LINKS)
for i = 1, #map, 2 do
  if map[i] ~= '~v' then
    reply[#reply + 1] = map[i]
    reply[#reply + 1] = map[i + 1]
  end
end
return reply
