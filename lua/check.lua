-- Floodgate check: every item of one request, atomically, with Redis TIME as the clock.
--
-- The agent runs this script as sliding_window.lua .. token_bucket.lua .. check.lua (one script, one
-- SHA), so that one call can mix algorithms and still be all or nothing: every item is evaluated
-- first, and costs are committed only if every enforced item passes, so a rejected request consumes
-- nothing. Items of rules in log mode (enforce = 0) are reported but never block the others.
--
-- KEYS[i]  the item's state, fg:{<client key>}:<rule id>. On a single node any keys may share a call;
--          on a Redis Cluster (issue 3) one call must carry keys of one hash tag only.
-- ARGV     7 per item: algorithm (1 sliding window | 2 token bucket), limit, window_ms, burst, cost,
--          mode (1 enforce | 0 log | 2 write back: add the cost whatever the verdict; used to return
--          what agents admitted locally while Redis was away), window (mode 2: the window index the
--          units were admitted in; 0 otherwise)
-- returns  5 integers per item: allowed (1 | 0), limit, remaining, reset_at_ms, retry_after_ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local commits = {}
local all_ok = true

for i = 1, #KEYS do
  local a = (i - 1) * 7
  local algorithm = ARGV[a + 1]
  local limit = tonumber(ARGV[a + 2])
  local window = tonumber(ARGV[a + 3])
  local burst = tonumber(ARGV[a + 4])
  local cost = tonumber(ARGV[a + 5])
  local mode = ARGV[a + 6]
  local verdict, commit
  if mode == '2' and algorithm == '1' then
    sliding_window_write_back(KEYS[i], now, window, cost, tonumber(ARGV[a + 7]))
    verdict, commit = { 1, limit, 0, 0, 0 }, function() end
  elseif algorithm == '1' then
    verdict, commit = sliding_window(KEYS[i], now, limit, window, cost)
  elseif algorithm == '2' then
    verdict, commit = token_bucket(KEYS[i], now, limit, window, burst, cost)
  else
    return redis.error_reply('ERR floodgate: unknown algorithm ' .. tostring(algorithm))
  end
  for _, x in ipairs(verdict) do out[#out + 1] = x end
  if mode == '2' then
    commit()
  elseif verdict[1] == 1 then
    commits[#commits + 1] = commit
  elseif mode == '1' then
    all_ok = false
  end
end

if all_ok then
  for _, commit in ipairs(commits) do commit() end
end
return out
