-- sites.lua: slots per proxy, slots and free slots of some sites (read-only). The caller picks the
-- sites (a page of P:siteidx, or the sites a heartbeat reported) and declares their keys.
-- KEYS: pairs, one per site: P:site:<site>, P:ready:<site>   (engine/keyset.py sites_keys)
-- ARGV[1]  "1": count slots and free slots too; "0": slots per proxy only
-- Replies:
--   {c_1, slots_1, free_1, ...}  c is "" for a site whose state has expired (leave it out); slots and
--        free are 0 without ARGV[1]
-- Cost: O(sites) (O(sites x log N) when counting).

local count = ARGV[1] == '1'
local now = count and now_ms() or 0
local reply = {}
for i = 1, #KEYS, 2 do
  local c = redis.call('HGET', KEYS[i], 'c')
  reply[#reply + 1] = c or ''
  if c and count then
    reply[#reply + 1] = redis.call('ZCARD', KEYS[i + 1])
    reply[#reply + 1] = redis.call('ZCOUNT', KEYS[i + 1], '-inf', now)
  else
    reply[#reply + 1] = 0
    reply[#reply + 1] = 0
  end
end
return reply
