-- sessions.lua: uses and remaining TTL of some sticky sessions (read-only; pool status detail rows).
-- KEYS: the session hashes P:session:<site>:<sid>   (engine/keyset.py session_keys)
-- Replies:
--   {uses_1, ttl_ms_1, ...}  0, 0 for a session that has ended

local reply = {}
for i = 1, #KEYS do
  local ttl = redis.call('PTTL', KEYS[i])
  if ttl < 0 then ttl = 0 end
  reply[#reply + 1] = tonumber(redis.call('HGET', KEYS[i], 'n')) or 0
  reply[#reply + 1] = ttl
end
return reply
