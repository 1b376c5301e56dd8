-- ban.lua: quarantine a proxy on a site (or site group), or proxy-wide, without holding a lease
-- (operators, the CLI, or a ban learned outside a lease).
-- KEYS: proxies bans banidx pstats sstats sitestats counters site ready
--        (roles in order, see engine/keyset.py: site/ready of the scope ARGV[1]; with scope "*" they
--        are declared but not touched)
-- ARGV[1]  scope: a site key, or "*" for a proxy-wide quarantine (dead proxy)
-- ARGV[2]  proxy id
-- ARGV[3]  reason    ARGV[4] base TTL, ms    ARGV[5] max TTL, ms
-- ARGV[6]  jitter fraction added to the TTL    ARGV[7] strike window, ms
-- Replies:
--   {"OK", until_ms, strikes, started}  started 1 if this call began the quarantine, 0 if one
--                                       was already running (no extra strike)
--   {"UNKNOWN"}                         no such proxy in the pool

-- Arguments are checked before the first write (a repeat of this call changes nothing more).
local bad = arg_str(1, 'scope') or arg_str(2, 'proxy id') or arg_str(3, 'reason')
  or arg_int(4, 'ban ttl ms', 1, MAX_MS) or arg_int(5, 'ban max ttl ms', 1, MAX_MS)
  or arg_num(6, 'jitter', -1, 1) or arg_int(7, 'strike window ms', 0, MAX_MS)
if bad then return redis.error_reply(bad) end

local scope, id = ARGV[1], ARGV[2]
if redis.call('HEXISTS', K_PROXIES, id) == 0 then return {'UNKNOWN'} end
local now = now_ms()
local until_ms, strikes, started = ban(scope, id, ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6]), tonumber(ARGV[7]), now)
return {'OK', until_ms, strikes, started}
