-- content.lua: what a content check (a required CSS selector, ...) on a site tells about the check.
-- A check that has never passed on a site and fails for every proxy's first answer is suspect: the
-- check (or the site), not the proxies, is wrong. So while a site's check never passed, its failures
-- quarantine nobody (the caller releases such an answer without a ban); once ARGV[5] distinct
-- proxies (fewer when the pool holds fewer) failed it with no pass, the site's circuit breaker opens
-- with cause "content" (the state of lease.lua's breaker gate: no lease for the site on any host).
-- Once the check passed on the site, its failures are bans as any other (the caller's release).
--   P:content:<site>  HASH  ok = ms the check first passed there (no field: never);
--                           f:<proxy id> = ms of that proxy's failure while it never passed;
--                           chk = the failing check (e.g. "missing_css div.product")
--                           Kept CONTENT_KEEP_MS after its last use.
-- KEYS: proxies sitestats breaker content   (roles in order, see engine/keyset.py; per-site keys of ARGV[1])
-- ARGV[1]  site    ARGV[2]  "pass" | "fail"    ARGV[3]  proxy id ("" with "pass")
-- ARGV[4]  the check, as logged (with "fail")
-- ARGV[5]  distinct proxies whose failure makes the check suspect enough to open the breaker
-- ARGV[6]  the site's breaker options, "threshold,min_proxies,window_ms,cooloff_ms,max_cooloff_ms,probes"
--          (see breaker_conf in _lib.lua): the cool-off, cap and probes of the opening
-- Replies:
--   {"PASSED", first}          recorded (first 1: the check passed there for the first time)
--   {"TRUSTED"}                the check passed there before: this failure is a ban as usual
--   {"SUSPECT", n, needed}     never passed; n distinct proxies failed so far (no quarantine)
--   {"OPENED", n, needed, cooloff_ms}  this failure made it n of needed: the breaker opened (cause content)
--   {"OPEN", n, needed}        never passed and the breaker is open already

local bad = arg_str(1, 'site') or arg_str(2, 'verdict') or arg_str(3, 'proxy id', true)
  or arg_str(4, 'check', true) or arg_int(5, 'suspect proxies', 1, MAX_CONCURRENCY) or arg_str(6, 'breaker')
if bad then return redis.error_reply(bad) end
local conf, bad_conf = breaker_conf(ARGV[6])
if bad_conf then return redis.error_reply(bad_conf) end
if not conf then return redis.error_reply('ERR scrapy-proxy-shard: argument breaker must not be empty') end
local CONTENT_KEEP_MS = 7 * 86400000
local site, verdict, id = ARGV[1], ARGV[2], ARGV[3]
local now = now_ms()
local passed = redis.call('HGET', K_CONTENT, 'ok')

if verdict == 'pass' then
  local first = 0
  if not passed then
    -- the failures seen so far were the proxies' or the site's, not the check's: forget them
    redis.call('DEL', K_CONTENT)
    redis.call('HSET', K_CONTENT, 'ok', istr(now))
    first = 1
  end
  redis.call('PEXPIRE', K_CONTENT, CONTENT_KEEP_MS)
  return {'PASSED', first}
end
if verdict ~= 'fail' then return redis.error_reply('ERR scrapy-proxy-shard: argument verdict must be pass or fail') end
if passed then
  redis.call('PEXPIRE', K_CONTENT, CONTENT_KEEP_MS)
  return {'TRUSTED'}
end
if id == '' then return redis.error_reply('ERR scrapy-proxy-shard: argument proxy id must not be empty') end
redis.call('HSET', K_CONTENT, 'f:' .. id, istr(now), 'chk', ARGV[4])
redis.call('PEXPIRE', K_CONTENT, CONTENT_KEEP_MS)
local n = redis.call('HLEN', K_CONTENT) - 1  -- the f: fields (no 'ok' here; 'chk' is the one other)
local needed = tonumber(ARGV[5])
local size = redis.call('HLEN', K_PROXIES)
if size > 0 and size < needed then needed = size end
if redis.call('EXISTS', K_BREAKER) == 1 then
  return {'OPEN', n, needed}
end
if n < needed then return {'SUSPECT', n, needed} end
redis.call('HSET', K_BREAKER, 'maxc', istr(conf.maxc), 'probes', conf.probes, 'since', istr(now), 'trips', 0,
  'cause', 'content', 'chk', ARGV[4])
breaker_open_for(conf.cool, now)
site_stat('brk_open')
return {'OPENED', n, needed, conf.cool}
