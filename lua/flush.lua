-- Floodgate flush: what one agent admitted locally for batched rules since its last flush, added to
-- the shared counts in one call, and the global counts read back.
--
-- The agent runs this script as sliding_window.lua .. flush.lua (one script, one SHA). Entries with
-- 0 units only read: the agent learns the global count of every key it checked since the last flush.
--
-- KEYS[i]  the entry's sliding-window prefix, fg:{<tag>}:<rule>/<bucket> (on a Redis Cluster one call
--          carries keys of one hash tag only)
-- ARGV     4 per entry: window_ms, target window (the units' window, agent's estimate of the Redis
--          clock), units, field (the client key)
-- returns  1 + 3 per entry: Redis now in ms, then per entry the current window index, its global
--          count and the previous window's (the units just added included)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = { now }
for i = 1, #KEYS do
  local a = (i - 1) * 4
  local window = tonumber(ARGV[a + 1])
  local target = tonumber(ARGV[a + 2])
  local units = tonumber(ARGV[a + 3])
  local field = ARGV[a + 4]
  if units > 0 then
    sliding_window_adjust(KEYS[i], field, now, window, units, target)
  end
  local idx = math.floor(now / window)
  local cur, prev = sliding_window_counts(KEYS[i], field, idx)
  out[#out + 1] = idx
  out[#out + 1] = cur
  out[#out + 1] = prev
end
return out
