-- Floodgate flush: what one agent admitted locally for batched rules since its last flush, added to
-- the shared counts in one call, and the global counts read back.
--
-- The agent runs this script as sliding_window.lua .. flush.lua (one script, one SHA). An entry with
-- units is a write (one HINCRBY, and the hash's expiry if this client was new in it); an entry with
-- 0 units is a learn, which reads the global counts back (two HGETs). Agents write at the start of a
-- flush slot and learn half a slot later, when every agent's write is in.
--
-- KEYS     2 per entry: its sliding window's two window hashes, fg:{<tag>}:<rule>/<bucket>:w0 and
--          :w1 (on a Redis Cluster one call carries keys of one hash tag only)
-- ARGV     4 per entry: window_ms, target window (the units' window, agent's estimate of the Redis
--          clock), units, field (the client key)
-- returns  1 + 3 per entry: Redis now in ms, then per entry the current window index and, for a
--          learn, its global count and the previous window's; for a write, the target window's
--          count after it (Redis runs writes one at a time, so each agent can tell exactly which
--          of its units went past the limit) and 0. Units an agent meant for the next window (its
--          estimate of the Redis clock ran ahead) count in the current one: by Redis's clock they
--          were admitted in it, and the next window's hash is the previous one's.
if #ARGV % 4 ~= 0 or #KEYS ~= #ARGV / 2 then
  return redis.error_reply('ERR floodgate: ' .. #KEYS .. ' keys and ' .. #ARGV .. ' arguments, not 2 and 4 per entry')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = { now }
for i = 1, #ARGV / 4 do
  local k0, k1 = KEYS[2 * i - 1], KEYS[2 * i]
  local a = (i - 1) * 4
  local window = tonumber(ARGV[a + 1])
  local target = tonumber(ARGV[a + 2])
  local units = tonumber(ARGV[a + 3])
  local field = ARGV[a + 4]
  local idx = math.floor(now / window)
  local cur, prev = 0, 0
  if units > 0 then
    -- A window that no longer weighs on the estimate takes nothing.
    if target == idx + 1 then target = idx end
    if target == idx or target == idx - 1 then
      local key
      if target == idx then
        key = sliding_window_key_now(k0, k1, now, idx, window)
      else
        key = sliding_window_key(k0, k1, target)
      end
      cur = redis.call('HINCRBY', key, field, units)
      if cur == units then
        redis.call('PEXPIREAT', key, sliding_window_expiry(target, window))
      end
    end
  else
    cur, prev = sliding_window_counts(k0, k1, field, now, idx, window)
  end
  out[#out + 1] = idx
  out[#out + 1] = cur
  out[#out + 1] = prev
end
return out
