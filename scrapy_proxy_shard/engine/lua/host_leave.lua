-- host_leave.lua: a Scrapy process that closes takes itself out of the pool's live hosts at once
-- (a crashed one ages out after its host TTL instead: see host_beat.lua).
-- KEYS: hosts hostinfo load hstats   (roles in order, see engine/keyset.py)
-- ARGV[1]  host id
-- ARGV[2]  instance token of the leaving process ("" or absent: leave whoever beats as the id); a
--          record holding another token is another process's (it took the id over): left alone
-- Replies:
--   {"OK", removed}  removed 1 if the host was registered
-- The host's counters and load history go too: a host id names one process, and a restarted
-- process starts from zero (the pool-wide counters per site and proxy keep everything).

local host = ARGV[1]
local token = ARGV[2] or ''
if token ~= '' then
  local raw = redis.call('HGET', K_HOSTINFO, host)
  local rec = raw and cjson.decode(raw) or {}
  if rec.token and rec.token ~= '' and rec.token ~= token then return {'OK', 0} end
end
local removed = redis.call('ZREM', K_HOSTS, host)
forget_host(host)
forget_host_counters(host)
return {'OK', removed}
