-- pool_status.lua: the slots of one site by state, the slots each host holds there, and on request
-- each slot that is not free: one chunk of the site's busy slots per call (read-only).
-- KEYS: bans site ready   (roles in order, see engine/keyset.py: site/ready of ARGV[1])
-- ARGV[1]  site
-- ARGV[2]  "1": list every busy slot of the chunk; "0": counts only
-- ARGV[3]  the instant the scan is taken at, ms: "0" on the first call (the Redis clock is used and
--          returned), then that reply's now_ms, so every chunk splits free from busy at one instant
-- ARGV[4]  offset into the busy slots (0, then the sum of the previous replies' scanned)
-- ARGV[5]  chunk size (busy slots examined by this call)
-- Replies:
--   {"OK", now_ms, slots, free, leased, session, cooling, banned, next_free_in_ms, scanned,
--    n_hosts, (host, slots_held) * n_hosts,
--    n_busy, (member, state, until_ms, host, session_id) * n_busy}
--        slots, free, next_free_in_ms: the whole site; leased..banned, hosts, rows: this chunk;
--        scanned < chunk size means the scan is done.
--        states: "leased" (a request holds it now), "session" (bound to a live sticky session, in
--        use or between its requests), "banned" (quarantined on the site or proxy-wide; a session
--        slot whose proxy is quarantined is "banned" too), "cooling" (resting after a release, or
--        a lease that expired without release). host and session_id are "" when not held. n_busy
--        is 0 without ARGV[2]. A session's uses and TTL are read by the caller (sessions.lua, with
--        the session keys declared).
--   {"UNKNOWN"}  the site has not been used with this pool lately (never, or idle past its idle TTL)
-- Cost: O(log N + offset + chunk) with three bulk reads per chunk (ZRANGEBYSCORE, two HMGETs), so a
-- status or a scrape never blocks Redis for long however big the pool (1-3 ms per 256 busy
-- slots); chunks are not one atomic view (a slot leased or released between two calls may be counted
-- in either state). Lease tokens are never returned.

local site, detail = ARGV[1], ARGV[2] == '1'
local c = redis.call('HGET', K_SITE, 'c')
if not c then return {'UNKNOWN'} end
local now = tonumber(ARGV[3])
if now == 0 then now = now_ms() end
local offset, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local ready = K_READY
local slots = redis.call('ZCARD', ready)
local free = redis.call('ZCOUNT', ready, '-inf', now)
local first = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
local next_in = 0
if #first > 0 and tonumber(first[2]) > now then next_in = tonumber(first[2]) - now end

local chunk = redis.call('ZRANGEBYSCORE', ready, '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', offset, limit)
local members, scores = {}, {}
for i = 1, #chunk, 2 do
  members[#members + 1] = chunk[i]
  scores[#scores + 1] = tonumber(chunk[i + 1])
end
local values, blocked = {}, {}
if #members > 0 then
  local records = redis.call('HMGET', K_SITE, unpack(members))
  for i = 1, #members do values[i] = live_record(records[i], now) or false end
  -- Quarantines matter only for slots nobody holds: one bulk read of their two ban entries.
  local fields, at = {}, {}
  for i, member in ipairs(members) do
    if not values[i] or string.sub(values[i], -1) ~= '|' then
      local id = id_of(member)
      fields[#fields + 1] = site .. '|' .. id
      fields[#fields + 1] = '*|' .. id
      at[#at + 1] = i
    end
  end
  if #fields > 0 then
    local entries = redis.call('HMGET', K_BANS, unpack(fields))
    for j, i in ipairs(at) do
      for _, entry in ipairs({entries[2 * j - 1], entries[2 * j]}) do
        if entry_until(entry) > now then blocked[i] = true end
      end
    end
  end
end

local counts = {leased = 0, session = 0, cooling = 0, banned = 0}
local by_host, hosts, busy = {}, {}, {}
for i, member in ipairs(members) do
  local v = values[i]
  local holder, sid = '', ''
  if v then holder, sid = held_by(v) end
  local state
  if v and sid == '' then
    state = 'leased'
  elseif blocked[i] then
    state = 'banned'
  elseif v then
    state = 'session'
  else
    state = 'cooling'
  end
  counts[state] = counts[state] + 1
  if v then
    if not by_host[holder] then
      by_host[holder] = 0
      hosts[#hosts + 1] = holder
    end
    by_host[holder] = by_host[holder] + 1
  end
  if detail then
    for _, x in ipairs({member, state, scores[i], holder, sid}) do busy[#busy + 1] = x end
  end
end

local reply = {'OK', now, slots, free, counts.leased, counts.session, counts.cooling, counts.banned, next_in,
  #members, #hosts}
for _, h in ipairs(hosts) do
  reply[#reply + 1] = h
  reply[#reply + 1] = by_host[h]
end
reply[#reply + 1] = #busy / 5
for _, x in ipairs(busy) do reply[#reply + 1] = x end
return reply
