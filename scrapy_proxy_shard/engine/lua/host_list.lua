-- host_list.lua: the fallback's read of a pool's live hosts, recorded as this host's last read.
-- A host that falls back to its own slice when Redis goes away takes it over the host list it read
-- last; another host may count on being in that list only if it registered before that read. So
-- each read is stamped, atomically with the list, into the reader's P:hostinfo record ("read",
-- Redis ms), and every reader gets each live host's registration ("since") and last read with the
-- list (see modes/hostview.py for the rule built on them).
-- KEYS: hosts hostinfo   (roles in order, see engine/keyset.py)
-- ARGV[1]  host id of the reader
-- Replies:
--   {"OK", now_ms, n, [host, alive_until_ms, since_ms, read_ms] * n}
--        only hosts whose TTL has not run out; since_ms / read_ms 0 when unknown. The reader's own
--        read_ms is this read's (now_ms) when it is live: a host that is not registered (no
--        heartbeat yet, or its TTL ran out) records nothing and finds itself absent
-- Cost: O(live hosts): one call per PROXY_SHARD_SNAPSHOT_INTERVAL per host and pool.

local bad = arg_str(1, 'host')
if bad then return redis.error_reply(bad) end
local me = ARGV[1]
local now = now_ms()
local live = redis.call('ZRANGEBYSCORE', K_HOSTS, '(' .. now, '+inf', 'WITHSCORES')
local reply = {'OK', now, #live / 2}
for i = 1, #live, 2 do
  local host = live[i]
  local raw = redis.call('HGET', K_HOSTINFO, host)
  local rec = raw and cjson.decode(raw) or {}
  if host == me and raw then
    rec.read = string.format('%d', now)
    redis.call('HSET', K_HOSTINFO, host, cjson.encode(rec))
  end
  reply[#reply + 1] = host
  reply[#reply + 1] = tonumber(live[i + 1])
  reply[#reply + 1] = tonumber(rec.since) or 0
  reply[#reply + 1] = tonumber(rec.read) or 0
end
return reply
