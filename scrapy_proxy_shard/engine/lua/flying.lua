-- flying.lua: on which of some sites one proxy is in flight, whatever host leased it (read-only).
-- An overlap veto for learned site groups (crawl/links.py, site_link.lua) is a clean answer while the
-- proxy had another request in flight. A host sees its own; with several hosts most overlaps are across
-- hosts, and their held records are here: a live record (its expiry not passed), not a sticky
-- session's binding, whose use started at or before ARGV[2] is a request sent before the caller's and
-- still unanswered (release deletes it).
-- KEYS: P:site:<site>, one per site the caller asks about   (engine/keyset.py flying_keys)
-- ARGV[1]  proxy id    ARGV[2] the caller's request's start, ms (Redis clock)
-- Replies:
--   {i, ...}  the 1-based positions in KEYS of the sites where the proxy is in flight so
-- Cost: O(sites x slots per proxy).

local id, since = ARGV[1], tonumber(ARGV[2])
if id == '' or not since then return redis.error_reply('ERR scrapy-proxy-shard: flying takes a proxy id and a start ms') end
local now = now_ms()
local reply = {}
for i = 1, #KEYS do
  local c = tonumber(redis.call('HGET', KEYS[i], 'c') or '0') or 0
  if c > 0 then
    local members = {}
    for k = 0, c - 1 do members[#members + 1] = id .. '/' .. k end
    for _, rec in ipairs(redis.call('HMGET', KEYS[i], unpack(members))) do
      local started = rec and live_record(rec, now) and lease_start(rec)
      if started and started <= since and select(2, held_by(rec)) == '' then
        reply[#reply + 1] = i
        break
      end
    end
  end
end
return reply
