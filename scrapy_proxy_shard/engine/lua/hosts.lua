-- hosts.lua: the live hosts of a pool with their heartbeat, counters and per-minute load (read-only).
-- KEYS: hosts hostinfo load hstats   (roles in order, see engine/keyset.py)
-- Replies:
--   {"OK", now_ms, n, [host, alive_until_ms, record, leases, ok, err, banned, load] * n}
--        only hosts whose TTL has not run out; record is the host's P:hostinfo JSON (beat, since,
--        seen, info: the JSON the host sent) and load its P:load JSON ({minute_ms: leases}); "{}"
--        when missing
-- Cost: O(live hosts * buckets kept): for the CLI and the exporter, not for the request path.

local now = now_ms()
local live = redis.call('ZRANGEBYSCORE', K_HOSTS, '(' .. now, '+inf', 'WITHSCORES')
local reply = {'OK', now, #live / 2}
for i = 1, #live, 2 do
  local host = live[i]
  local c = host_counters(host)
  reply[#reply + 1] = host
  reply[#reply + 1] = tonumber(live[i + 1])
  reply[#reply + 1] = redis.call('HGET', K_HOSTINFO, host) or '{}'
  for j = 1, 4 do reply[#reply + 1] = c[j] end
  reply[#reply + 1] = redis.call('HGET', K_LOAD, host) or '{}'
end
return reply
