-- tier.lua: which tier of an ordered tier list (pools, cheap -> expensive: PROXY_SHARD_TIERS) one site
-- leases from, for every host. One step: count the answers a host reports, escalate or come down,
-- and hand out the probe of the lower tier when it is due. The state follows use: it expires
-- idle_ms after the site's last step (the site starts again on the cheapest tier).
--   <T>:site:<site>  HASH  t = the tier, n / b = answers / bans on it in the window (halved each
--                          window_ms from ws), pn = ms the next probe of tier t - 1 is due (0: none),
--                          pb = the probe interval learned (ms: doubles when a probe or a descent
--                          fails), pf = ms an unanswered probe counts as lost (0: none in flight),
--                          dn = ms of the last descent, up = escalations of the site
--   <T>:counts       HASH  per tier i: l:i leases, ok:i fine answers, ban:i bans, up:i escalations
--                          to it, down:i descents to it, probe:i probes of it, pban:i probes banned
--   <T>:on:<i>       ZSET  per tier: site -> ms its state expires (the sites on tier i now)
-- KEYS: site counts on:0 ... on:n-1   (engine/keyset.py tier_keys; all under the tier list's hash tag)
-- ARGV[1]  site (for the on:<i> ZSETs)
-- ARGV[2]  the host's counts since its last step, "leases,ok,bans" per tier, comma-separated, tier 0
--          first (n x 3 numbers)
-- ARGV[3]  the tier on which a circuit breaker opened for the site (-1: none): escalate now
-- ARGV[4]  a probe's answer: "" (none), "ok", "ban" or "skip" (no verdict, or it got no proxy)
-- ARGV[5]  the tier that probe went to
-- ARGV[6]  "1": claim the probe of the lower tier if it is due
-- ARGV[7]  "min_answers,ban_ratio,window_ms,probe_ms,max_probe_ms,probe_ttl_ms,idle_ms"
-- Replies:
--   {tier, granted, event, next_probe_ms, backoff_ms, answers, bans}
--      granted 1: this call holds the probe of tier - 1 (answer it with ARGV[4]); event "" | "up" |
--      "down" | "probe_banned" | "probe_skipped"; next_probe_ms: ms until the next probe is due
--      (-1 on the cheapest tier)
-- Cost: O(tiers + log sites).

local n_tiers = #KEYS - 2
if n_tiers < 1 then return redis.error_reply('ERR scrapy-proxy-shard: tier.lua takes 3 or more keys') end
local bad = arg_str(1, 'site') or arg_int(3, 'breaker tier', -1, n_tiers - 1) or arg_str(4, 'probe answer', true)
  or arg_int(5, 'probe tier', -1, n_tiers - 1) or arg_str(6, 'claim') or arg_str(7, 'options')
if bad then return redis.error_reply(bad) end
local o = {}
for x in string.gmatch(ARGV[7], '[^,]+') do o[#o + 1] = tonumber(x) end
if #o ~= 7 then return redis.error_reply('ERR scrapy-proxy-shard: argument options must hold 7 numbers') end
local min_answers, ratio, window, probe_ms, max_probe, probe_ttl, idle = o[1], o[2], o[3], o[4], o[5], o[6], o[7]
local counts = {}
for x in string.gmatch(ARGV[2], '[^,]+') do counts[#counts + 1] = tonumber(x) or 0 end
if #counts ~= 3 * n_tiers then
  return redis.error_reply('ERR scrapy-proxy-shard: argument counts must hold 3 numbers per tier')
end
local site, answer, probe_tier, claim = ARGV[1], ARGV[4], tonumber(ARGV[5]), ARGV[6] == '1'
local now = now_ms()

local raw = redis.call('HMGET', KEYS[1], 't', 'n', 'b', 'ws', 'pn', 'pb', 'pf', 'dn')
local t = tonumber(raw[1]) or 0
if t > n_tiers - 1 then t = n_tiers - 1 end
local old_t = tonumber(raw[1])
local n, b = tonumber(raw[2]) or 0, tonumber(raw[3]) or 0
local ws, pn, pb = tonumber(raw[4]) or now, tonumber(raw[5]) or 0, tonumber(raw[6]) or probe_ms
local pf, dn = tonumber(raw[7]) or 0, tonumber(raw[8]) or 0
local event = ''

for i = 0, n_tiers - 1 do
  local l, ok, bans = counts[3 * i + 1], counts[3 * i + 2], counts[3 * i + 3]
  if l > 0 then redis.call('HINCRBY', KEYS[2], 'l:' .. i, l) end
  if ok > 0 then redis.call('HINCRBY', KEYS[2], 'ok:' .. i, ok) end
  if bans > 0 then redis.call('HINCRBY', KEYS[2], 'ban:' .. i, bans) end
end
if now - ws >= window then  -- an old window counts half: what the site does now weighs most
  n, b, ws = math.floor(n / 2), math.floor(b / 2), now
end
n = n + counts[3 * t + 2] + counts[3 * t + 3]
b = b + counts[3 * t + 3]

if answer ~= '' then
  pf = 0
  if answer == 'ok' and t > 0 and probe_tier == t - 1 then
    -- the lower tier is served again: come down (the interval learned is kept for the next probe)
    t, n, b, ws, dn, event = t - 1, 0, 0, now, now, 'down'
    redis.call('HINCRBY', KEYS[2], 'down:' .. t, 1)
    pn = t > 0 and now + pb or 0
  elseif answer == 'ban' then
    pb = math.min(pb * 2, max_probe)
    pn, event = now + pb, 'probe_banned'
    redis.call('HINCRBY', KEYS[2], 'pban:' .. probe_tier, 1)
  elseif t > 0 then
    pn, event = now + pb, 'probe_skipped'
  end
end

local breaker_tier = tonumber(ARGV[3])
if event == '' and t < n_tiers - 1 and (breaker_tier == t or (n >= min_answers and b >= ratio * n)) then
  -- the site blocks this tier: every host moves up. A descent that did not hold (the site blocks the
  -- lower tier again within a window) doubles the wait before the next probe; otherwise it starts over.
  if dn > 0 and now - dn < window then pb = math.min(pb * 2, max_probe) else pb = probe_ms end
  t, n, b, ws, pf, event = t + 1, 0, 0, now, 0, 'up'
  pn = now + pb
  redis.call('HINCRBY', KEYS[2], 'up:' .. t, 1)
  redis.call('HINCRBY', KEYS[1], 'up', 1)
end

local granted = 0
if claim and t > 0 and pn > 0 and now >= pn and (pf == 0 or pf <= now) then
  granted, pf = 1, now + probe_ttl
  redis.call('HINCRBY', KEYS[2], 'probe:' .. (t - 1), 1)
end

redis.call('HSET', KEYS[1], 't', t, 'n', n, 'b', b, 'ws', istr(ws), 'pn', istr(pn), 'pb', istr(pb),
  'pf', istr(pf), 'dn', istr(dn))
redis.call('PEXPIRE', KEYS[1], idle)
if old_t and old_t ~= t and old_t < n_tiers then redis.call('ZREM', KEYS[3 + old_t], site) end
redis.call('ZADD', KEYS[3 + t], now + idle, site)
redis.call('ZREMRANGEBYSCORE', KEYS[3 + t], '-inf', now)
redis.call('PEXPIRE', KEYS[3 + t], idle)
redis.call('PEXPIRE', KEYS[2], 30 * 86400000)
return {t, granted, event, pn > 0 and math.max(0, pn - now) or -1, pb, n, b}
