-- sites.lua: one page of the sites a pool serves now (used within their idle TTL), read-only.
-- KEYS[1]  pool prefix "{namespace:pool}"
-- ARGV[1]  offset into P:siteidx (0, then the previous reply's next offset)
-- ARGV[2]  page size
-- Replies:
--   {next_offset, site_1, slots_per_proxy_1, ...}  next_offset 0 when this was the last page; a site
--        whose state has expired but whose index entry was not pruned yet is left out
-- Cost: O(log S + page), so listing thousands of sites never blocks Redis for long.

local bad = check_args({{1, 'offset', 0, 1e12}, {2, 'page size', 1, 10000}})
if bad then return redis.error_reply(bad) end
local offset, page = tonumber(ARGV[1]), tonumber(ARGV[2])
local names = redis.call('ZRANGE', K_SITEIDX, offset, offset + page - 1)
local reply = {0}
if #names == page then reply[1] = offset + page end
for _, site in ipairs(names) do
  local c = redis.call('HGET', site_key(site), 'c')
  if c then
    reply[#reply + 1] = site
    reply[#reply + 1] = c
  end
end
return reply
