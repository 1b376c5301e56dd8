-- hosts.lua: the live hosts of a pool with their heartbeat, counters and per-minute load (read-only).
-- KEYS[1]  pool prefix "{namespace:pool}"
-- Replies:
--   {"OK", now_ms, n, [host, alive_until_ms, beat_ms, since_ms, info, leases, ok, err, banned,
--    n_buckets, (minute_ms, leases) * n_buckets] * n}
--        only hosts whose TTL has not run out; info is the JSON the host sent ("{}" if missing)
-- Cost: O(live hosts * buckets kept): for the CLI and the exporter, not for the request path.

local now = now_ms()
local live = redis.call('ZRANGEBYSCORE', K_HOSTS, '(' .. now, '+inf', 'WITHSCORES')
local reply = {'OK', now, #live / 2}
for i = 1, #live, 2 do
  local host = live[i]
  local h = redis.call('HMGET', host_key(host), 'beat', 'since', 'info')
  local c = host_counters(host)
  reply[#reply + 1] = host
  reply[#reply + 1] = tonumber(live[i + 1])
  reply[#reply + 1] = tonumber(h[1]) or 0
  reply[#reply + 1] = tonumber(h[2]) or 0
  reply[#reply + 1] = h[3] or '{}'
  for j = 1, 4 do reply[#reply + 1] = c[j] end
  local load = redis.call('HGETALL', load_key(host))
  reply[#reply + 1] = #load / 2
  for j = 1, #load do reply[#reply + 1] = tonumber(load[j]) end
end
return reply
