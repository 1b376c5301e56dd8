-- hold.lua: take one named slot if it is free: adopt, into Redis, a lease that was made by a host's
-- local fallback engine while Redis was unreachable, so no other host is handed that slot.
-- Two modes (ARGV[8]): "0", a lease not yet handed to a request: taken only if the slot is free now
-- (its ready score has passed and its proxy is not quarantined, on the site or proxy-wide);
-- "1", a lease already in flight (its request runs whatever Redis says): taken unless another live
-- held record has it, even while the slot is cooling or quarantined (the slot is then ready no sooner
-- than before, and the release paces it as any other); if another live record has it (the overlap
-- happened during the outage), the slot's ready score is pushed to at least now + TTL (GT) and the
-- answer is BUSY: nobody else is handed it before then, even when that holder releases it earlier
-- (the overlap floor, see floor_field) until that lease ends: its host calls lift.lua with this
-- call's token when its request ends, and the floor then drops to the other overlaps' ends, if any.
-- KEYS: memo proxies meta order bans pstats hstats sitestats siteidx site ready
--        (roles in order, see engine/keyset.py: memo = P:done:hold:<token>, per-site keys of ARGV[1])
-- ARGV[1]  site    ARGV[2]  member "<id>/<k>"    ARGV[3]  concurrency (slots per proxy, if the
--          site is new)    ARGV[4]  TTL, ms    ARGV[5]  token    ARGV[6]  host id
-- ARGV[7]  site idle TTL, ms (see lease.lua)    ARGV[8]  "1": the lease is in flight (see above), else "0"
-- Replies:
--   {"OK", expires_ms, now_ms, url}  the slot is now held with this token (url: the proxy's URL)
--   {"BUSY", wait_ms}           the slot is held, cooling or quarantined in Redis (in flight: held by
--                               another live record only; wait_ms until that record runs out)
--   {"UNKNOWN"}                 no such slot (proxy not in the pool, or site built with fewer slots)
--   {"MIGRATE"}                 the pool was written by an older version: PoolStore.migrate first
-- Arguments are checked before the first write; a repeated call with the same token answers the
-- first OK again.

local bad = arg_str(1, 'site') or arg_str(2, 'member') or arg_str(5, 'token') or arg_str(6, 'host')
  or arg_int(3, 'concurrency', 1, MAX_CONCURRENCY) or arg_int(4, 'ttl ms', 1, MAX_MS)
  or arg_int(7, 'site idle ttl ms', 1000, MAX_MS) or arg_int(8, 'in flight flag', 0, 1)
if bad then return redis.error_reply(bad) end
local earlier = recall(K_MEMO)
if earlier then
  earlier[4] = redis.call('HGET', K_PROXIES, id_of(ARGV[2]) or '')
  if not earlier[4] then return {'UNKNOWN'} end
end
if earlier then return earlier end

local site, member = ARGV[1], ARGV[2]
local concurrency, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local token, host = ARGV[5], ARGV[6]
local idle = tonumber(ARGV[7])
local migrate, pool_seq = pool_layout()
if migrate then return {'MIGRATE'} end
local now = now_ms()
local url = redis.call('HGET', K_PROXIES, id_of(member) or '')
if not url then return {'UNKNOWN'} end
local c = ensure_site(site, concurrency, now, pool_seq)
local ready = K_READY
local score = redis.call('ZSCORE', ready, member)
if not score then
  -- Not learnt by the site yet (a large pool): take it in now, if the site has that slot.
  local k = tonumber(string.match(member, '/(%d+)$'))
  if not k or k >= c then
    touch_site(site, now, idle, now)  -- ensure_site may have made the site: it expires when idle
    return {'UNKNOWN'}
  end
  score = slot_free_at(site, id_of(member), member, now)
  redis.call('ZADD', ready, 'NX', score, member)
end
score = tonumber(score)
local ready_at = now + ttl
if ARGV[8] == '1' then
  local rec = redis.call('HMGET', K_SITE, member, floor_field(member))
  local other = live_record(rec[1], now)
  if other then
    redis.call('ZADD', ready, 'GT', ready_at, member)
    redis.call('HSET', K_SITE, floor_field(member), not_before_floor(ready_at, rec[2]))
    -- Each overlapping lease's own end, by this call's token: lift.lua ends its part when it ends.
    local ends = overlap_ends(member, now)
    ends[token] = ready_at
    set_overlap_ends(member, ends)
    touch_site(site, ready_at, idle, now)
    return {'BUSY', held_until(other) - now}
  end
  if score > ready_at then ready_at = score end
else
  -- A proxy-wide quarantine is not in the site's ready score (a lease checks it where it picks the
  -- proxy): a lease not yet handed to a request waits for it too.
  local free_at = score
  if free_at <= now then free_at = blocked_until(site, id_of(member)) end
  if free_at > now then
    touch_site(site, now, idle, now)
    return {'BUSY', free_at - now}
  end
end
redis.call('ZADD', ready, ready_at, member)
redis.call('HSET', K_SITE, member, held_record(token, host, now, now + ttl, ''))
touch_site(site, now + ttl, idle, now)
redis.call('HINCRBY', K_PSTATS, id_of(member) .. ':l', 1)
redis.call('HINCRBY', K_HSTATS, host .. ':l', 1)
return remember(K_MEMO, {'OK', now + ttl, now, url}, 4)
