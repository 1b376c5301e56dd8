-- pool_status.lua: every slot of one site by state, the leases each host holds there, and on request
-- each slot that is not free (read-only).
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV[1]  site
-- ARGV[2]  "1": list every slot that is not free; "0": counts only
-- Replies:
--   {"OK", now_ms, slots, free, leased, session, cooling, banned, next_free_in_ms,
--    n_hosts, (host, leases_held) * n_hosts,
--    n_busy, (member, state, until_ms, host, session_id, uses, session_ttl_ms) * n_busy}
--        states: "leased" (a request holds it now), "session" (bound to a live sticky session, in
--        use or between its requests), "banned" (quarantined on the site or proxy-wide; a session
--        slot whose proxy is quarantined is "banned" too), "cooling" (resting after a release, or
--        a lease that expired without release); free slots are not listed. host and session_id are
--        "" when not held; uses and session_ttl_ms are 0 outside sessions. n_busy is 0 without ARGV[2].
--   {"UNKNOWN"}  the site has not been used with this pool yet
-- Cost: O(log N + B) where B is the number of slots that are not free: for the CLI and the
-- exporter, never for the request path. Lease tokens are never returned.

local site, detail = ARGV[1], ARGV[2] == '1'
local c = redis.call('HGET', K_SITES, site)
if not c then return {'UNKNOWN'} end
local now = now_ms()
local ready = ready_key(site)
local slots = redis.call('ZCARD', ready)
local free = redis.call('ZCOUNT', ready, '-inf', now)
local counts = {leased = 0, session = 0, cooling = 0, banned = 0}
local by_host, hosts = {}, {}
local busy = {}
local nbusy = 0
local members = redis.call('ZRANGEBYSCORE', ready, '(' .. now, '+inf', 'WITHSCORES')
for i = 1, #members, 2 do
  local member, until_ms = members[i], tonumber(members[i + 1])
  local id = id_of(member)
  local v = redis.call('GET', lease_key(site, member))
  local holder, sid = '', ''
  if v then
    holder, sid = string.match(v, '^[^|]*|([^|]*)|[^|]*|(.*)$')
    holder, sid = holder or '', sid or ''
  end
  local state
  if v and sid == '' then
    state = 'leased'
  elseif blocked_until(site, id) > now then
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
    local uses, sttl = 0, 0
    if sid ~= '' then
      local S = session_key(site, sid)
      uses = tonumber(redis.call('HGET', S, 'n')) or 0
      sttl = redis.call('PTTL', S)
      if sttl < 0 then sttl = 0 end
    end
    nbusy = nbusy + 1
    local row = {member, state, until_ms, holder, sid, uses, sttl}
    for _, x in ipairs(row) do busy[#busy + 1] = x end
  end
end
local first = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
local next_in = 0
if #first > 0 and tonumber(first[2]) > now then next_in = tonumber(first[2]) - now end
local reply = {'OK', now, slots, free, counts.leased, counts.session, counts.cooling, counts.banned, next_in,
  #hosts}
for _, h in ipairs(hosts) do
  reply[#reply + 1] = h
  reply[#reply + 1] = by_host[h]
end
reply[#reply + 1] = nbusy
for _, x in ipairs(busy) do reply[#reply + 1] = x end
return reply
